"""KV block metadata and the O(1) LRU queue of free blocks.

The queue is a doubly linked list threaded through the blocks themselves, with head and tail
sentinels so that no operation needs a branch for an empty list. Free blocks that still hold a
prefix-cache hash stay in the queue (and in the hash map) until they are popped for reuse:
the head is the least recently freed block, the first to be evicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Hash of the full block's contents (see block_hash.py); None while partial or uncached.
    block_hash: int | None = None
    # Tail-hit candidates (tail_hits.py): the lookup key and the tokens whose KV the block holds
    # (all of them for a full cached block, the computed ones of a freed partial block).
    tail_key: tuple | None = field(default=None, repr=False)
    tail_tokens: tuple[int, ...] | None = field(default=None, repr=False)
    # Links for FreeBlockQueue; both None while the block is not in the queue.
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        h = None if self.block_hash is None else f"{self.block_hash & 0xFFFF:04x}.."
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; every operation is O(1) (append_n is O(n))."""

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        # Sentinels carry id -1 and are never handed out.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head (next to evict) to tail. For tests and integrity checks."""
        out = []
        cur = self._head.next_free_block
        while cur is not self._tail:
            assert cur is not None
            out.append(cur)
            cur = cur.next_free_block
        return out

    def __len__(self) -> int:
        return self.num_free_blocks
