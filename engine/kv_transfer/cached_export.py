"""The holder's half of a fetch from a peer: copy blocks of a prompt's prefix out of this engine's
prefix cache for another engine (awaiting_kv.py is the fetching half).

Runs on the step thread between steps. The blocks are looked up by the prompt's hashes (the
same chain the fetching engine computes, so a hit means the same tokens under the same adapter,
salt and KV dtype), held by one reference while they are read, and let go at once: a fetch never
pins the holder's blocks beyond the copy, and a block evicted before the fetch came is a miss.
Reads go behind any step in flight (same device stream; remote ranks queue them behind their
steps), so a block published for a step still running is read after that step wrote it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from engine.core.block_hash import extend_block_hashes
from engine.core.kv_cache_manager import KVCacheManager
from engine.kv_transfer.blocks import KVBlocks, KVLayout
from engine.lora.request import LoRARequest, adapter_hash_root


def export_cached(
    kv_cache_manager: KVCacheManager,
    read_blocks: Callable[[list[int]], torch.Tensor],
    layout: KVLayout,
    prompt_token_ids: Sequence[int],
    first_block: int,
    num_blocks: int,
    lora_request: LoRARequest | None = None,
    cache_salt: str | None = None,
) -> KVBlocks | None:
    """The cached blocks `first_block .. first_block + num_blocks - 1` of `prompt_token_ids`'s
    chain, every KV head; None when any of them is not cached here (evicted, never held)."""
    bs = kv_cache_manager.block_size
    end = first_block + num_blocks
    if num_blocks <= 0 or len(prompt_token_ids) < end * bs:
        return None
    root = adapter_hash_root(kv_cache_manager.hash_root, lora_request)
    hashes = extend_block_hashes([], list(prompt_token_ids[: end * bs]), bs, cache_salt, root)
    pool = kv_cache_manager.block_pool
    blocks = [pool.get_cached_block(h) for h in hashes[first_block:end]]
    if any(b is None for b in blocks):
        return None
    pool.touch(blocks)  # no allocation may hand them out while they are read
    try:
        data = read_blocks([b.block_id for b in blocks])
    finally:
        pool.free_blocks(reversed(blocks))  # back where they were: still cached, now recently used
    return KVBlocks(layout, first_block, end * bs, data)
