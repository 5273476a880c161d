"""The C++ paged decode kernel against the PyTorch reference backend on random paged caches."""
from __future__ import annotations

import pytest
import torch

from engine.attn_metadata_builder import build_step_batch
from engine.layers.attention.backend import get_backend
from engine.runner_state import RunnerRequestState
from engine.sampling_params import SamplingParams


def _batch(block_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    states, counts, next_block = [], [], 0
    # decode rows of varied lengths (incl. one exactly at a block edge), then two prefill chunks
    for i, (ctx, n) in enumerate([(1, 1), (3, 1), (8, 1), (17, 1), (30, 1), (0, 9), (12, 6)]):
        nblk = -(-(ctx + n) // block_size)
        blocks = torch.randperm(40, generator=g)[:nblk].add(next_block).tolist()
        next_block += 40
        toks = list(range(ctx + n))
        states.append(RunnerRequestState(f"r{i}", toks, [], SamplingParams(), blocks, ctx))
        counts.append(n)
    return states, counts


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_paged_kernel_matches_reference(dtype, tol):
    kernel = get_backend("cpu_paged")
    ref = get_backend("reference")
    states, counts = _batch()
    batch = build_step_batch(states, counts, 4, "cpu")
    hkv, g, d = 2, 3, 16
    t = batch.input_ids.shape[0]
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, hkv, 7 * 40, 4, d, generator=gen).to(dtype)
    q = torch.randn(t, hkv * g, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    c1, c2 = cache.clone(), cache.clone()
    a = ref.forward(q, k, v, c1, batch.meta, 0.25)
    b = kernel.forward(q, k, v, c2, batch.meta, 0.25)
    assert torch.equal(c1, c2)  # same slot writes
    assert (a.float() - b.float()).abs().max().item() < tol
