"""KV events: which prefix-cache block hashes an engine holds, as a numbered stream of changes.

The block pool records, in order, the hashes it starts holding (`BlocksStored`: a hash got its
first block), stops holding (`BlocksRemoved`: its last block was evicted for reuse) and
`AllBlocksCleared` (prefix cache reset). After each step the engine core publishes what the
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
from dataclasses import dataclass
from typing import Callable, Union


@dataclass(frozen=True, slots=True)
class BlocksStored:
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    hashes: tuple[int, ...]


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
    hashes: frozenset[int]


class KVEventRecorder:
    """The block pool's side (one thread): consecutive events of one kind share one entry."""

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: list[tuple[str, list[int]]] = []

    def stored(self, block_hash: int) -> None:
        self._add("stored", block_hash)

    def removed(self, block_hash: int) -> None:
        self._add("removed", block_hash)

    def cleared(self) -> None:
        self._events = [("cleared", [])]  # what came before it no longer matters

    def _add(self, kind: str, block_hash: int) -> None:
        if self._events and self._events[-1][0] == kind:
            self._events[-1][1].append(block_hash)
        else:
            self._events.append((kind, [block_hash]))

    def take(self) -> tuple[KVEvent, ...]:
        events, self._events = self._events, []
        return tuple(_freeze(kind, hashes) for kind, hashes in events)


def _freeze(kind: str, hashes: list[int]) -> KVEvent:
    if kind == "stored":
        return BlocksStored(tuple(hashes))
    if kind == "removed":
        return BlocksRemoved(tuple(hashes))
    return AllBlocksCleared()


def apply_events(held: set[int], events: tuple[KVEvent, ...]) -> None:
    """The one meaning of a batch: the engine's log and every reader's index apply it so."""
    for ev in events:
        if type(ev) is BlocksStored:
            held.update(ev.hashes)
        elif type(ev) is BlocksRemoved:
            held.difference_update(ev.hashes)
        else:
            held.clear()


class KVEventLog:
    """Published batches: the last `capacity` kept for readers catching up, plus the held set."""

    def __init__(self, capacity: int = 1024) -> None:
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self._held: set[int] = set()
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
            apply_events(self._held, events)
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
            return KVSnapshot(self.epoch, self.seq, frozenset(self._held))
