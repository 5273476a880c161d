"""Which block hashes the offload tier holds, and where: hash -> slot, least recently used first.

Owned by the scheduler (rank 0), as the pool's block ids are; every rank's store (store.py) has
the same slots over its own KV shard. A slot with a load in flight is pinned: the LRU passes it
over, so no save in the same step reuses it before its bytes are read. Every hash entering or
leaving the index is a KV event of the tier's medium.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.core.kv_events import KVEventRecorder


class OffloadIndex:
    def __init__(self, num_slots: int, events: KVEventRecorder, medium: str) -> None:
        self.num_slots, self.events, self.medium = num_slots, events, medium
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash -> slot, oldest first
        self._free = list(range(num_slots - 1, -1, -1))  # slot 0 first
        self._pins: dict[int, int] = {}  # hash -> loads in flight
        self.num_dropped = 0  # cumulative: hashes the LRU let go for newer ones

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def slot(self, block_hash: int) -> int | None:
        return self._lru.get(block_hash)

    def touch(self, block_hash: int) -> None:
        """Used now: the last to be dropped."""
        self._lru.move_to_end(block_hash)

    def add(self, block_hash: int) -> int | None:
        """A slot for a block leaving the pool, the least recently used unpinned hash dropped to
        make room; None when the hash is held already (touched) or every slot is pinned."""
        if block_hash in self._lru:
            self.touch(block_hash)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            old = next((h for h in self._lru if h not in self._pins), None)
            if old is None:
                return None
            slot = self._lru.pop(old)
            self.events.removed(old, self.medium)
            self.num_dropped += 1
        self._lru[block_hash] = slot
        self.events.stored(block_hash, self.medium)
        return slot

    def drop(self, block_hash: int) -> None:
        """Forget a hash whose slot did not hold it (a failed load)."""
        slot = self._lru.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)
            self.events.removed(block_hash, self.medium)

    def pin(self, block_hash: int) -> None:
        self._pins[block_hash] = self._pins.get(block_hash, 0) + 1

    def unpin(self, block_hash: int) -> None:
        n = self._pins.get(block_hash, 0) - 1
        if n > 0:
            self._pins[block_hash] = n
        else:
            self._pins.pop(block_hash, None)

    def clear(self) -> None:
        """Forget every hash (a prefix cache reset: its event clears every medium)."""
        self._lru.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))

    def check(self) -> None:
        slots = list(self._lru.values())
        assert len(set(slots)) == len(slots), "two hashes share a slot"
        assert not set(slots) & set(self._free), "a held slot is free"
        assert len(slots) + len(self._free) == self.num_slots, "slots lost"
