"""The router's exact index of where prompt blocks live: per engine replica, the set of prefix-
cache block hashes it holds, kept from that replica's KV event stream (engine/core/kv_events.py).

Fed from two paths (both in the ingress process): the batches riding on this ingress's output
channels, and the `kv_events` feed (router/ingress/kv_subscriber.py), which also carries other
ingresses' changes and the snapshots. Batches are applied strictly in sequence order; one that
arrives early waits for the ones before it, and a gap that does not fill (or another epoch: the
engine restarted) asks the feed for a snapshot (`needs_snapshot`).

Requests routed here but not yet seen in the events count as provisional holders of their
blocks (`pending`), so a burst with one prefix does not scatter before the first event returns.

Blocks a replica keeps in its offload tier (events of medium "disk" or "host",
engine/kv_offload/) are indexed apart: such a block is a load away from a hit, which the
cache-aware choice weighs below a block in the pool (`tier_blocks`).
"""

from __future__ import annotations

import threading
from typing import Iterable, Sequence

from engine.core.kv_events import DEVICE, KVEventBatch, KVSnapshot, apply_events, media

MAX_EARLY = 256  # batches held while waiting for a missing one; past it, resync from a snapshot


class ReplicaBlocks:
    __slots__ = ("epoch", "seq", "hashes", "tiers", "early", "needs_snapshot")

    def __init__(self) -> None:
        self.epoch: str | None = None
        self.seq = 0
        self.hashes: set[int] = set()  # in the KV pool
        self.tiers: dict[str, set[int]] = {}  # offload medium -> hashes held there
        self.early: dict[int, KVEventBatch] = {}
        self.needs_snapshot = True  # nothing known yet

    def reset(self, snap: KVSnapshot) -> None:
        self.epoch, self.seq, self.hashes = snap.epoch, snap.seq, set(snap.hashes)
        self.tiers = {m: set(h) for m, h in snap.tiers.items()}
        self.early = {s: b for s, b in self.early.items() if b.epoch == snap.epoch and s > snap.seq}
        self.needs_snapshot = False
        self._drain()

    def apply(self, batch: KVEventBatch) -> None:
        if batch.epoch != self.epoch:
            if self.epoch is not None:  # the engine restarted behind this replica id
                self.needs_snapshot = True
            self.early[batch.seq] = batch  # usable once a snapshot of that epoch arrives
        elif batch.seq > self.seq:
            self.early[batch.seq] = batch
            self._drain()
        if len(self.early) > MAX_EARLY:
            self.early.clear()
            self.needs_snapshot = True

    def _drain(self) -> None:
        while (b := self.early.pop(self.seq + 1, None)) is not None:
            if b.epoch != self.epoch:
                self.early[b.seq] = b
                return
            apply_events(self.hashes, b.events)
            for m in (media(b.events) - {DEVICE}) | self.tiers.keys():
                apply_events(self.tiers.setdefault(m, set()), b.events, m)
            self.seq = b.seq


class KVIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # the ingress loop writes; Serve's routing loop reads
        self.replicas: dict[str, ReplicaBlocks] = {}
        self.pending: dict[str, tuple[str, Sequence[int]]] = {}  # request id -> (replica, hashes)

    def _get(self, replica: str) -> ReplicaBlocks:
        rb = self.replicas.get(replica)
        if rb is None:
            rb = self.replicas[replica] = ReplicaBlocks()
        return rb

    def apply(self, replica: str, batches: Iterable[KVEventBatch]) -> None:
        with self._lock:
            rb = self._get(replica)
            for b in batches:
                rb.apply(b)

    def reset(self, replica: str, snap: KVSnapshot) -> None:
        with self._lock:
            self._get(replica).reset(snap)

    def position(self, replica: str) -> tuple[str | None, int, bool]:
        """(epoch, seq, needs a snapshot) for the feed's next call."""
        with self._lock:
            rb = self._get(replica)
            return rb.epoch, rb.seq, rb.needs_snapshot

    def drop(self, replica: str) -> None:
        """A replica left: its entries leave the index."""
        with self._lock:
            self.replicas.pop(replica, None)
            for rid in [r for r, (rep, _) in self.pending.items() if rep == replica]:
                del self.pending[rid]

    def cached_blocks(self, replica: str, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` the replica holds (as far as the events say)."""
        with self._lock:
            rb = self.replicas.get(replica)
            held = rb.hashes if rb is not None else ()
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
            return n

    def tier_blocks(self, replica: str, hashes: Sequence[int], start: int) -> int:
        """Blocks of `hashes` from `start` on (past the pool's hits) that the replica's offload
        tier holds, in a row."""
        with self._lock:
            rb = self.replicas.get(replica)
            if rb is None or not rb.tiers:
                return 0
            n = 0
            for h in hashes[start:]:
                if not any(h in held for held in rb.tiers.values()):
                    break
                n += 1
            return n

    def pending_blocks(self, replica: str, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` that requests routed to the replica will store there."""
        best = 0
        with self._lock:
            for rep, theirs in self.pending.values():
                if rep != replica or best >= len(hashes) or theirs[0] != hashes[0]:
                    continue
                n, m = 0, min(len(hashes), len(theirs))
                while n < m and hashes[n] == theirs[n]:
                    n += 1
                best = max(best, n)
        return best

    def held_blocks(self, replica: str) -> int:
        """Blocks the replica holds plus those its routed, not yet seen requests will store."""
        with self._lock:
            rb = self.replicas.get(replica)
            held = len(rb.hashes) if rb is not None else 0
            return held + sum(len(h) for rep, h in self.pending.values() if rep == replica)

    def add_pending(self, request_id: str, replica: str, hashes: Sequence[int]) -> None:
        if hashes:
            with self._lock:
                self.pending[request_id] = (replica, hashes)

    def move_pending(self, request_id: str, replica: str) -> None:
        with self._lock:
            p = self.pending.get(request_id)
            if p is not None and p[0] != replica:
                self.pending[request_id] = (replica, p[1])

    def end_pending(self, request_id: str) -> None:
        with self._lock:
            self.pending.pop(request_id, None)

    def known(self) -> list[str]:
        with self._lock:
            return list(self.replicas)

    def sizes(self) -> dict[str, int]:
        """Hashes known per replica (debugging, tests)."""
        with self._lock:
            return {r: len(rb.hashes) for r, rb in self.replicas.items()}
