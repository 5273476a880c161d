"""Per-request block tables on top of the BlockPool, with prefix-cache lookup.

Who may share blocks through the hash map:
- with prefix caching on: every request (a cache_salt isolates its chain from other salts);
- with prefix caching off: only requests that carry a cache_salt (the front end gives the
  siblings of one n>1 request one salt, so they share prompt blocks copy-free); requests
  without a salt neither look up nor publish blocks.

Blocks are published in the hash map when they are *scheduled* to be filled (vLLM V1), so a
request scheduled later in the same step can already hit them. This relies on the runner's
usual contract: for each layer, the KV of every scheduled token is written into the cache
before that layer's attention reads any block. Tail hits (tail_hits.py) copy slots before the
forward instead, so they never copy from a block published in the same step.
"""

from __future__ import annotations

from typing import Iterable

from engine.core.block_hash import kv_hash_root, max_hit_blocks, update_block_hashes
from engine.core.block_pool import BlockPool
from engine.core.free_block_queue import KVCacheBlock
from engine.core.tail_hits import TailHit, tail_key
from engine.kv_offload.tier import OffloadTier
from engine.lora.request import adapter_hash_root
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        kv_cache_dtype: str = "auto",
        offload_slots: int = 0,
        offload_medium: str = "disk",
    ) -> None:
        self.block_size = block_size
        self.hash_root = kv_hash_root(kv_cache_dtype)  # the KV dtype salts every chain
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        # Hashing stays on in the pool: salted siblings share even with prefix caching off.
        self.block_pool = BlockPool(num_blocks)
        # The offload tier (engine/kv_offload/): evicted blocks kept by hash; None: off.
        self.offload: OffloadTier | None = None
        if offload_slots > 0:
            self.offload = OffloadTier(offload_slots, self.block_pool.events, offload_medium)
            self.block_pool.on_evict = self.offload.evicted
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already published in the hash map.
        self.num_cached_block: dict[str, int] = {}
        # Tail hits of the step being scheduled: (src block, dst block, slots) for the runner,
        # their sources held until the step has run, and the blocks published during this
        # schedule (their KV is written by its forward, after the copies).
        self._copies: list[tuple[int, int, int]] = []
        self._pinned: list[KVCacheBlock] = []
        self._fresh: set[int] = set()

    def root_of(self, request: Request) -> int | None:
        """The parent of the request's first block: the KV dtype's root, and its LoRA adapter's
        identity when it has one (two adapters never share KV)."""
        return adapter_hash_root(self.hash_root, request.lora_request)

    def can_share(self, request: Request) -> bool:
        return self.enable_prefix_caching or request.cache_salt is not None

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest chain of cached full blocks at the start of the request's tokens.

        Never covers the last token: it must be recomputed to produce logits.
        """
        if not self.can_share(request) or request.sampling_params.needs_every_prompt_position:
            # Prompt logprobs and mean pooling need every prompt position computed, so no hits.
            return [], 0
        hashes = update_block_hashes(request, self.block_size, self.root_of(request))
        max_blocks = max_hit_blocks(request.num_tokens, self.block_size)
        blocks: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def count_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """The prefix-cache figures of a request admitted with `num_hit_tokens` found in the
        pool. Counted once per admission, not per lookup: a request at the head of a queue that
        cannot take it is looked up again every step."""
        self.block_pool.record_prefix_query(request.num_tokens, num_hit_tokens)

    def offload_hits(self, request: Request, num_hit_blocks: int) -> list[int]:
        """After `num_hit_blocks` pool hits: the hashes that continue the chain in the offload
        tier (none when the tier is off or the request may not hit)."""
        if self.offload is None or not self.can_share(request) or request.sampling_params.needs_every_prompt_position:
            return []
        max_blocks = max_hit_blocks(request.num_tokens, self.block_size)
        return self.offload.hits(request.block_hashes[num_hit_blocks:max_blocks])

    def find_tail(self, request: Request, num_hit_blocks: int) -> TailHit | None:
        """After `num_hit_blocks` full-block hits: a cached block whose leading tokens continue
        the request's (tail_hits.py), never covering its last token."""
        if not self.can_share(request) or request.sampling_params.needs_every_prompt_position:
            return None
        start = num_hit_blocks * self.block_size
        limit = min(request.num_tokens - 1 - start, self.block_size)
        if limit <= 0:
            return None
        want = request.all_token_ids[start : start + limit]
        return self.block_pool.tails.longest(self._tail_key(request, num_hit_blocks), want, self._fresh)

    def _tail_key(self, request: Request, index: int) -> tuple:
        """The tail-index key of the request's block `index` (its block hashes cover index - 1)."""
        parent = request.block_hashes[index - 1] if index else self.root_of(request)
        return tail_key(parent, request.cache_salt, index, request.all_token_ids[index * self.block_size])

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        publish: bool = True,
        tail: TailHit | None = None,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` after the request's computed tokens (plus the hit
        blocks `new_computed_blocks` and the `tail` hit's tokens, not yet counted in
        `request.num_computed_tokens`). `publish=False`: the new blocks' contents come from
        elsewhere later (a remote prefill), so they stay out of the hash map until `publish_blocks`.

        Returns the ids of the freshly allocated blocks (maybe []), or None when the pool is
        short; on None nothing changed.
        """
        computed = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed_tokens = request.num_computed_tokens + len(computed) * self.block_size
        if tail is not None:
            assert num_computed_tokens == (len(req_blocks) + len(computed)) * self.block_size, (
                "tail after a partial block"
            )
            num_computed_tokens += tail.num_tokens
        total = num_computed_tokens + num_new_tokens
        num_new_blocks = max(0, cdiv(total, self.block_size) - len(req_blocks) - len(computed))
        # Hit blocks (and a tail hit's source) that sit in the free queue stop being free once touched.
        num_free_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if tail is not None and tail.block.ref_cnt == 0:
            num_free_hits += 1
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_free_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(computed)
        req_blocks.extend(computed)
        if tail is not None:  # held until the step that copies from it has run
            self.block_pool.touch([tail.block])
            self._pinned.append(tail.block)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        if tail is not None:
            self._copies.append((tail.block.block_id, new_blocks[0].block_id, tail.num_tokens))
            self.block_pool.prefix_cache_hits += tail.num_tokens
        req_blocks.extend(new_blocks)
        if publish and self.can_share(request):
            self._cache_blocks(request, min(total, request.num_tokens) // self.block_size)
        return [b.block_id for b in new_blocks]

    def publish_blocks(self, request: Request, num_tokens: int) -> None:
        """The request's first `num_tokens` tokens are now in its blocks: publish the full ones."""
        if self.can_share(request):
            self._cache_blocks(request, min(num_tokens, request.num_tokens) // self.block_size)

    def _cache_blocks(self, request: Request, num_full_blocks: int) -> None:
        num_cached = self.num_cached_block.get(request.request_id, 0)
        if num_full_blocks <= num_cached:
            return
        update_block_hashes(request, self.block_size, self.root_of(request))
        blocks = self.req_to_blocks[request.request_id]
        self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full_blocks)
        self.num_cached_block[request.request_id] = num_full_blocks
        tokens, bs = request.all_token_ids, self.block_size
        for i in range(num_cached, num_full_blocks):
            block = blocks[i]
            if block.tail_key is None:  # a hit block is a candidate already
                self.block_pool.tails.add(block, self._tail_key(request, i), tokens[i * bs : (i + 1) * bs])
                self._fresh.add(block.block_id)

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first (so its tail is evicted first). Its
        partial last block stays a tail-hit candidate until it is reused."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self._unpublish_unwritten(request, blocks)
        self._remember_partial(request, blocks)
        self.block_pool.free_blocks(reversed(blocks))

    def _unpublish_unwritten(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """Blocks are published when scheduled to be filled. A request preempted in the step that
        scheduled them (priority policy: a victim already scheduled gives its tokens back) never
        fills them, so its blocks past `num_computed_tokens` leave the hash map before they are
        freed: a later hit (the victim itself, resumed) would read KV that was never written."""
        for i in range(request.num_computed_tokens // self.block_size, len(blocks)):
            block = blocks[i]
            if block.block_hash is not None and block.ref_cnt == 1:
                self.block_pool.uncache(block)

    def _remember_partial(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """`num_computed_tokens` counts exactly the KV written, or scheduled in a step launched
        before any that reads the block (each stage runs steps in launch order; a request
        waiting for remote KV counts only its hits), so its first slots are valid."""
        if not self.can_share(request):
            return
        index, filled = divmod(request.num_computed_tokens, self.block_size)
        if not filled or index >= len(blocks):
            return
        block = blocks[index]
        if block.block_hash is not None or block.ref_cnt != 1:
            return
        update_block_hashes(request, self.block_size, self.root_of(request))
        start = index * self.block_size
        self.block_pool.tails.add(block, self._tail_key(request, index), request.all_token_ids[start : start + filled])

    # --- tail-hit copies --------------------------------------------------------------------

    def begin_step(self) -> None:
        """A new schedule: blocks published before it hold their KV now."""
        self._fresh.clear()

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The copies the runner performs before this step's forward."""
        copies, self._copies = self._copies, []
        return copies

    def release_copy_sources(self, block_ids: Iterable[int] | None = None) -> None:
        """A step has run: the blocks it copied from (the sources of its `kv_copies`; None: every
        block held as a source) are no longer held. Other steps in flight keep theirs."""
        if block_ids is None:
            done, self._pinned = self._pinned, []
        else:
            done = []
            for block_id in block_ids:
                i = next(i for i, b in enumerate(self._pinned) if b.block_id == block_id)
                done.append(self._pinned.pop(i))
        if done:
            self.block_pool.free_blocks(done)

    def trim(self, request: Request, num_tokens: int) -> int | None:
        """Free the request's blocks past those holding its first `num_tokens` tokens (KV of
        rejected draft tokens). Returns the blocks it keeps, or None when nothing was freed."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return None
        assert self.num_cached_block.get(request.request_id, 0) <= keep, "a cached block held a draft"
        tail = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(tail))
        return keep

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()
        if self.offload is not None:
            self.offload.clear()
        # Published blocks lost their hashes; do not re-publish them for running requests.

    # --- stats ------------------------------------------------------------------------------

    def usage(self) -> float:
        return self.block_pool.get_usage()

    def kv_waste(self, requests: Iterable[Request]) -> float:
        """(allocated slots - tokens stored) / allocated slots over the given requests."""
        slots = stored = 0
        for req in requests:
            n = len(self.req_to_blocks.get(req.request_id, ()))
            if n:
                slots += n * self.block_size
                stored += min(req.num_computed_tokens, n * self.block_size)
        return (slots - stored) / slots if slots else 0.0

    def stats(self, running: Iterable[Request] = ()) -> dict:
        pool = self.block_pool
        return {
            "num_blocks": self.num_blocks,
            "blocks_used": pool.get_num_used_blocks(),
            "blocks_free": pool.get_num_free_blocks(),
            "blocks_cached": pool.get_num_cached_blocks(),
            "usage": pool.get_usage(),
            "prefix_cache_queries": pool.prefix_cache_queries,
            "prefix_cache_hits": pool.prefix_cache_hits,
            "prefix_hit_rate": pool.prefix_hit_rate,
            "num_evictions": pool.num_evictions,
            "kv_waste": self.kv_waste(running),
            **(self.offload.stats() if self.offload is not None else {}),
        }

    def check_integrity(self) -> None:
        self.block_pool.check_integrity()
        # Every reference is held by exactly one request's block table.
        refs: dict[int, int] = {}
        for blocks in [*self.req_to_blocks.values(), self._pinned]:
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.block_pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), f"ref count {b} != holders"
        if self.offload is not None:
            self.offload.index.check()
