"""Random paged-attention steps (decode rows + prompt chunks with cached context) for comparing
attention backends: the metadata comes from the engine's own step builder."""

from __future__ import annotations

import torch

from engine.layers.attention.kv_quant import SCALE_BYTES, is_quantized_cache
from engine.runner.attn_metadata_builder import build_step_batch
from engine.runner.runner_state import RunnerRequestState


def make_step(decode_ctx: list[int], chunks: list[tuple[int, int]], block_size: int, num_blocks: int, seed: int = 0):
    """States and counts for decode rows with `decode_ctx` cached tokens each and prompt chunks
    (cached, new); every sequence gets distinct random blocks of a `num_blocks` pool."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=g).tolist()
    states, counts = [], []
    for i, (ctx, new) in enumerate([(c, 1) for c in decode_ctx] + list(chunks)):
        need = -(-(ctx + new) // block_size)
        blocks, free = free[:need], free[need:]
        assert len(blocks) == need, "pool too small for the case"
        states.append(RunnerRequestState(f"r{i}", [0] * (ctx + new), [], None, blocks, ctx))
        counts.append(new)
    return states, counts


def run_backend(backend, states, counts, cache, hq, scale, seed=1, dtype=None):
    """(output rows, cache after the write) of one step of `backend` over a copy of `cache`."""
    cache = cache.clone()
    _, hkv, _, bs, d = cache.shape
    if is_quantized_cache(cache.dtype):
        d -= SCALE_BYTES  # rows carry their scales
    batch = build_step_batch(states, counts, bs, cache.device, decode_buckets=backend.uses_decode_buckets)
    t = sum(counts)
    g = torch.Generator().manual_seed(seed)
    dtype = dtype or cache.dtype
    assert not is_quantized_cache(dtype), "a quantized cache takes float q/k/v: pass dtype"
    q, k, v = (torch.randn(t, h, d, generator=g).to(cache.device, dtype) for h in (hq, hkv, hkv))
    return backend.forward(q, k, v, cache, batch.meta, scale), cache


def random_cache(hkv, num_blocks, block_size, d, dtype, device, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, hkv, num_blocks, block_size, d, generator=g).to(device, dtype)


def random_quant_cache(hkv, num_blocks, block_size, d, storage, device, seed=2):
    """A cache of quantized rows (int8 or float8_e4m3fn values + float16 scales, kv_quant.py)."""
    from engine.layers.attention.kv_quant import quantize_rows

    return quantize_rows(random_cache(hkv, num_blocks, block_size, d, torch.float32, "cpu", seed), storage).to(device)
