"""KV events: which prefix-cache block hashes an engine holds, as a numbered stream of changes.

The block pool records, in order, the hashes it starts holding (`BlocksStored`: a hash got its
first block), stops holding (`BlocksRemoved`: its last block was evicted for reuse) and
`AllBlocksCleared` (prefix cache reset: every medium). Each stored/removed event names its
`medium`, as vLLM's and Dynamo's KV events do: "device" is the engine's KV pool (the only one a
reader that predicts pool hits applies), "disk" and "host" the offload tier (engine/kv_offload/),
which keeps a block evicted from the pool until it is loaded back. After each step the engine core publishes what the
step recorded as one `KVEventBatch` with the next sequence number (`KVEventLog.publish`).

Readers in other threads (the serving layer) get batches through listeners, catch up from a
sequence number with `since`, or take a consistent `snapshot` (the log keeps its own copy of the
held hashes, so no reader touches the pool). `epoch` names this log: a reader that saw another
epoch (a restarted engine) must start from a snapshot. Stays free of Ray: the router side
subscribes through the serving layer (ARCHITECTURE.md, rule 1).
"""

from __future__ import annotations

import collections
import threading
import uuid
from dataclasses import dataclass, field
from typing import Callable, Union

DEVICE = "device"  # the KV pool's medium


@dataclass(frozen=True, slots=True)
class BlocksStored:
    hashes: tuple[int, ...]
    medium: str = DEVICE


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    hashes: tuple[int, ...]
    medium: str = DEVICE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = Union[BlocksStored, BlocksRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    epoch: str
    seq: int  # 1, 2, ... per epoch; a reader applies them in order
    events: tuple[KVEvent, ...]


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    epoch: str
    seq: int  # the state after batch `seq`
    hashes: frozenset[int]  # in the KV pool
    # Other media (the offload tier): medium -> hashes held there.
    tiers: dict[str, frozenset[int]] = field(default_factory=dict)


class KVEventRecorder:
    """The block pool's side (one thread): consecutive events of one kind share one entry."""

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: list[tuple[str, str, list[int]]] = []

    def stored(self, block_hash: int, medium: str = DEVICE) -> None:
        self._add("stored", medium, block_hash)

    def removed(self, block_hash: int, medium: str = DEVICE) -> None:
        self._add("removed", medium, block_hash)

    def cleared(self) -> None:
        self._events = [("cleared", DEVICE, [])]  # what came before it no longer matters

    def _add(self, kind: str, medium: str, block_hash: int) -> None:
        if self._events and self._events[-1][:2] == (kind, medium):
            self._events[-1][2].append(block_hash)
        else:
            self._events.append((kind, medium, [block_hash]))

    def take(self) -> tuple[KVEvent, ...]:
        events, self._events = self._events, []
        return tuple(_freeze(kind, medium, hashes) for kind, medium, hashes in events)


def _freeze(kind: str, medium: str, hashes: list[int]) -> KVEvent:
    if kind == "stored":
        return BlocksStored(tuple(hashes), medium)
    if kind == "removed":
        return BlocksRemoved(tuple(hashes), medium)
    return AllBlocksCleared()


def apply_events(held: set[int], events: tuple[KVEvent, ...], medium: str = DEVICE) -> None:
    """The one meaning of a batch: the engine's log and every reader's index apply it so.
    `held`: the hashes in `medium` (the KV pool unless told); events of other media pass by."""
    for ev in events:
        if type(ev) is AllBlocksCleared:
            held.clear()
        elif ev.medium != medium:
            continue
        elif type(ev) is BlocksStored:
            held.update(ev.hashes)
        else:
            held.difference_update(ev.hashes)


def media(events: tuple[KVEvent, ...]) -> set[str]:
    """The media a batch's stored/removed events name."""
    return {ev.medium for ev in events if type(ev) is not AllBlocksCleared}


class KVEventLog:
    """Published batches: the last `capacity` kept for readers catching up, plus the held set."""

    def __init__(self, capacity: int = 1024) -> None:
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self._held: dict[str, set[int]] = {DEVICE: set()}  # medium -> hashes
        self._recent: collections.deque[KVEventBatch] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._listeners: list[Callable[[KVEventBatch], None]] = []

    def add_listener(self, fn: Callable[[KVEventBatch], None]) -> None:
        """`fn(batch)` runs on the publishing (engine) thread after each batch: keep it short."""
        self._listeners.append(fn)

    def publish(self, events: tuple[KVEvent, ...]) -> KVEventBatch | None:
        if not events:
            return None
        with self._lock:
            self.seq += 1
            batch = KVEventBatch(self.epoch, self.seq, events)
            for m in media(events) - self._held.keys():
                self._held[m] = set()
            for m, held in self._held.items():
                apply_events(held, events, m)
            self._recent.append(batch)
        for fn in self._listeners:
            fn(batch)
        return batch

    def since(self, epoch: str, seq: int) -> list[KVEventBatch] | None:
        """Batches after `seq`, or None when they are not all kept (or another epoch): the
        reader then needs a snapshot."""
        with self._lock:
            if epoch != self.epoch or seq > self.seq:
                return None
            if seq == self.seq:
                return []
            if not self._recent or self._recent[0].seq > seq + 1:
                return None
            return [b for b in self._recent if b.seq > seq]

    def snapshot(self) -> KVSnapshot:
        with self._lock:
            tiers = {m: frozenset(h) for m, h in self._held.items() if m != DEVICE}
            return KVSnapshot(self.epoch, self.seq, frozenset(self._held[DEVICE]), tiers)
