"""The pool of KV blocks: ref counts, the LRU free queue and the prefix-cache hash map.

Every block is either in use (ref_cnt > 0) or in the free queue (ref_cnt == 0). A block with a
hash is "cached" whether in use or free; a free cached block keeps its hash until it is popped
for reuse (eviction happens only then), so a later request can revive it with `touch`.

No null block is reserved: all `num_blocks` ids (0..num_blocks-1) are usable, which keeps the
block ids in tests equal to the order of allocation.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from engine.core.free_block_queue import FreeBlockQueue, KVCacheBlock
from engine.core.kv_events import KVEventRecorder
from engine.core.tail_hits import TailIndex
from engine.request import Request


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # hash -> {block_id: block}. Several blocks may hold the same contents (two requests
        # completed the same block in one step); any of them serves a hit.
        self.cached_block_hash_to_block: dict[int, dict[int, KVCacheBlock]] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.num_evictions = 0
        # Hashes entering and leaving the map, in order (engine/core/kv_events.py).
        self.events = KVEventRecorder()
        # Blocks a token-granular hit may copy from (tail_hits.py); forgotten on eviction too.
        self.tails = TailIndex()
        # Called with (block, hash) when an eviction leaves no block holding that hash, before
        # the block is handed out: the offload tier keeps its bytes (engine/kv_offload/tier.py).
        self.on_evict: Callable[[KVCacheBlock, int], None] | None = None

    # --- allocation -------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue (LRU first), evicting their hashes."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks, {self.get_num_free_blocks()} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0, block
            block_hash = block.block_hash
            if self._unhash(block):
                self.num_evictions += 1
                if self.on_evict is not None and block_hash not in self.cached_block_hash_to_block:
                    self.on_evict(block, block_hash)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _unhash(self, block: KVCacheBlock) -> bool:
        """Take the block out of the hash map and the tail index; True if it had a hash."""
        self.tails.drop(block)
        if block.block_hash is None:
            return False
        same = self.cached_block_hash_to_block.get(block.block_hash)
        if same is not None:
            same.pop(block.block_id, None)
            if not same:
                del self.cached_block_hash_to_block[block.block_hash]
                self.events.removed(block.block_hash)
        block.block_hash = None
        return True

    def uncache(self, block: KVCacheBlock) -> None:
        """Take a block out of the hash map (and the tail index) now: its contents will not be
        what its hash says (published for a step whose tokens were given back). Not counted as
        an eviction: the block never held those tokens."""
        self._unhash(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on hit blocks; a free one leaves the free queue (it is in use now)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching 0 go to the tail in the given order, so callers pass
        a request's blocks in reverse and its tail blocks are evicted before its prefix."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    # --- prefix cache -----------------------------------------------------------------------

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under the request's block hashes."""
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], request.block_hashes[i]
            if block.block_hash is not None:
                # A prefix hit: it already carries this very hash.
                assert block.block_hash == block_hash, (block, i)
                continue
            block.block_hash = block_hash
            same = self.cached_block_hash_to_block.get(block_hash)
            if same is None:
                same = self.cached_block_hash_to_block[block_hash] = {}
                self.events.stored(block_hash)
            same[block.block_id] = block

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        same = self.cached_block_hash_to_block.get(block_hash)
        if not same:
            return None
        return next(iter(same.values()))

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every hash (in-use blocks keep their contents but can no longer be hit)."""
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.tails.clear(self.blocks)
        self.events.cleared()
        self.prefix_cache_queries = self.prefix_cache_hits = 0

    # --- stats ------------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_num_used_blocks(self) -> int:
        return self.num_blocks - self.get_num_free_blocks()

    def get_num_cached_blocks(self) -> int:
        return sum(len(v) for v in self.cached_block_hash_to_block.values())

    def get_usage(self) -> float:
        return self.get_num_used_blocks() / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def check_integrity(self) -> None:
        """Assert the pool's invariants; tests call it after every step."""
        free = self.free_block_queue.get_all_free_blocks()
        free_ids = {b.block_id for b in free}
        assert len(free) == len(free_ids) == self.free_block_queue.num_free_blocks, "queue corrupt"
        for block in self.blocks:
            if block.block_id in free_ids:
                assert block.ref_cnt == 0, f"free block in use: {block}"
            else:
                assert block.ref_cnt > 0, f"leaked block (ref 0, not free): {block}"
                assert block.prev_free_block is None and block.next_free_block is None, block
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert len(free) + used == self.num_blocks, "free + used != total"
        hashed = {b.block_id for b in self.blocks if b.block_hash is not None}
        mapped = set()
        for block_hash, same in self.cached_block_hash_to_block.items():
            assert same, "empty hash entry"
            for block_id, block in same.items():
                assert block is self.blocks[block_id] and block.block_hash == block_hash, block
                mapped.add(block_id)
        assert hashed == mapped, f"hashed blocks {hashed} != mapped blocks {mapped}"
        self.tails.check(self.blocks)
