"""The scheduler half of the offload tier: what each step saves and loads, and the requests
waiting for their loads.

Save: when the pool evicts a cached block whose hash has no other block left in the pool
(BlockPool.get_new_blocks), the hash gets a slot in the index and the step's scheduler output
carries (block id, slot, hash): every rank copies the block out at the start of that step, before
the block's new owner writes into it. A hash the tier holds already is only touched (its bytes
are the same).

Load: a prefix lookup that runs out of pool hits goes on along the hash chain into the index
(KVCacheManager.offload_hits). Such a request gets fresh blocks for those hashes (unpublished,
like a remote prefill's: engine/kv_transfer/awaiting_kv.py) and waits while the step's output
carries (slot, block id, hash) and every rank copies the bytes in; the runner reports the loads
that failed on any rank. Then the loaded blocks are published in the pool's hash map and the
request is scheduled as a prefix hit; a failed load drops the hash and its block is recomputed.
The wait costs one step (on CUDA the loads run beside its forward: rank_io.py). Its lookup is
counted when it is admitted after the load: prefix_cache_hits counts every hit, whatever tier it
came from, and prefix_cache_hits_offload the part loaded from this one.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.core.kv_events import KVEventRecorder
from engine.kv_offload.index import OffloadIndex
from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.core.free_block_queue import KVCacheBlock
    from engine.core.kv_cache_manager import KVCacheManager


class OffloadTier:
    def __init__(self, num_slots: int, events: KVEventRecorder, medium: str) -> None:
        self.index = OffloadIndex(num_slots, events, medium)
        self.medium = medium
        self._saves: list[tuple[int, int, int]] = []  # (block id, slot, hash) of this schedule
        self._loads: list[tuple[int, int, int]] = []  # (slot, block id, hash) of this schedule
        self._load_owner: list[str] = []  # the request of each of _loads
        # Requests whose loads are in flight: id -> (request, hashes loaded, tokens hit before them).
        self.waiting: dict[str, tuple[Request, list[int], int]] = {}
        self.blocks_saved = 0  # cumulative
        self.blocks_loaded = 0
        self.load_failures = 0  # blocks whose load failed (recomputed)
        self.hit_tokens = 0  # prompt tokens loaded instead of recomputed

    # --- saves ------------------------------------------------------------------------------

    def evicted(self, block: KVCacheBlock, block_hash: int) -> None:
        """The pool let go of the last block holding `block_hash`: keep its bytes."""
        slot = self.index.add(block_hash)
        if slot is not None:
            self._saves.append((block.block_id, slot, block_hash))
            self.blocks_saved += 1

    # --- loads ------------------------------------------------------------------------------

    def hits(self, hashes: list[int]) -> list[int]:
        """The leading hashes the tier holds."""
        n = 0
        while n < len(hashes) and hashes[n] in self.index:
            n += 1
        return hashes[:n]

    def hold(
        self,
        kv: KVCacheManager,
        req: Request,
        hit_blocks: list[KVCacheBlock],
        num_hit: int,
        hashes: list[int],
    ) -> bool:
        """Fresh blocks for `hashes` after the `num_hit` tokens in `hit_blocks`, and their loads
        in this step. False: the pool is short, nothing changed."""
        # Pinned before allocating (its evictions must not drop them); touched tail first, so
        # the chain's head is the last the LRU drops (a block is no use without its parent).
        for h in reversed(hashes):
            self.index.pin(h)
            self.index.touch(h)
        ids = kv.allocate_slots(req, len(hashes) * kv.block_size, hit_blocks, publish=False)
        if ids is None:
            for h in hashes:
                self.index.unpin(h)
            return False
        assert len(ids) == len(hashes), (ids, hashes)
        for h, block_id in zip(hashes, ids):
            self._loads.append((self.index.slot(h), block_id, h))
            self._load_owner.append(req.request_id)
        req.num_computed_tokens = num_hit
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting[req.request_id] = (req, hashes, num_hit)
        return True

    def take_ops(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]], list[str]]:
        """This schedule's saves and loads (for the scheduler output), and each load's request."""
        ops = self._saves, self._loads, self._load_owner
        self._saves, self._loads, self._load_owner = [], [], []
        return ops

    def loads_done(
        self, kv: KVCacheManager, loads: list[tuple[int, int, int]], owners: list[str], failed: set[int]
    ) -> list[Request]:
        """A step's loads ran; `failed`: the indices of those that failed on some rank. The
        loaded blocks (up to each request's first failure) are published in the pool and the
        request lets go of all its blocks: it is returned to be queued first, and its lookup then
        hits them in the pool (holding nothing while it waits, it can never block the queue)."""
        ok_upto: dict[str, int] = {}  # request -> blocks loaded before its first failure
        for i, ((_, _, h), rid) in enumerate(zip(loads, owners)):
            self.index.unpin(h)
            if i in failed:
                self.index.drop(h)
                self.load_failures += 1
                ok_upto.setdefault(rid, sum(1 for j in range(i) if owners[j] == rid))
        back = []
        for rid in dict.fromkeys(owners):
            entry = self.waiting.pop(rid, None)
            if entry is None:
                continue  # finished or aborted meanwhile: its blocks were freed
            req, hashes, num_hit = entry
            n = ok_upto.get(rid, len(hashes))
            self.blocks_loaded += n
            self.hit_tokens += n * kv.block_size
            req.num_computed_tokens = num_hit + n * kv.block_size
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
            kv.publish_blocks(req, req.num_computed_tokens)
            kv.free(req)  # tail first: the loaded prefix is the last of them to be evicted
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            back.append(req)
        return back

    def forget(self, request_id: str) -> None:
        """A waiting request ended; its loads' pins go when their step is done."""
        self.waiting.pop(request_id, None)

    def clear(self) -> None:
        self.index.clear()

    def stats(self) -> dict:
        return {
            "offload_capacity_blocks": self.index.num_slots,
            "offload_blocks_held": len(self.index),
            "offload_blocks_saved": self.blocks_saved,
            "offload_blocks_loaded": self.blocks_loaded,
            "offload_blocks_dropped": self.index.num_dropped,
            "offload_load_failures": self.load_failures,
            "prefix_cache_hits_offload": self.hit_tokens,
            "num_waiting_for_offload": len(self.waiting),
        }
