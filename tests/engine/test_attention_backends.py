"""The C++ paged decode and prefill kernels against the PyTorch reference backend on random paged caches."""

from __future__ import annotations

import pytest
import torch

from engine.layers.attention.selector import get_backend
from engine.runner.attn_metadata_builder import build_step_batch
from engine.runner.runner_state import RunnerRequestState
from engine.sampling_params import SamplingParams


def _batch(block_size=4, seed=0, rows=((1, 1), (3, 1), (8, 1), (17, 1), (30, 1), (0, 9), (12, 6))):
    g = torch.Generator().manual_seed(seed)
    states, counts, next_block = [], [], 0
    # decode rows of varied lengths (incl. one exactly at a block edge), then two prefill chunks
    for i, (ctx, n) in enumerate(rows):
        nblk = -(-(ctx + n) // block_size)
        blocks = torch.randperm(40, generator=g)[:nblk].add(next_block).tolist()
        next_block += 40
        toks = list(range(ctx + n))
        states.append(RunnerRequestState(f"r{i}", toks, [], SamplingParams(), blocks, ctx))
        counts.append(n)
    return states, counts


class _Recording:
    """The C++ ops module, noting what prefill_attention answered."""

    def __init__(self, ops):
        self.ops, self.prefill_results = ops, []

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def prefill_attention(self, *args):
        self.prefill_results.append(self.ops.prefill_attention(*args))
        return self.prefill_results[-1]


# Shapes cover the kernel's vector paths: head_dim 16/64/128 (and 24, which no vector path
# takes), block sizes that are not 16 (a 16-token chunk then spans blocks), GQA groups 1-4,
# and contexts past several 16-token chunks.
_LONG = ((1, 1), (15, 1), (16, 1), (47, 1), (100, 1), (0, 9), (12, 6))
# Prompt chunks past several 16-position work items and key tiles, with and without context.
_PREFILL = ((5, 1), (0, 2), (0, 37), (21, 50), (64, 16), (3, 17))


SHAPES = [  # (KV heads, GQA group, head_dim, block size, rows)
    (2, 3, 16, 4, None),
    (3, 3, 64, 16, _LONG),
    (1, 4, 128, 8, _LONG),
    (2, 1, 64, 32, _LONG),
    (2, 2, 24, 16, _LONG),
    (3, 3, 64, 16, _PREFILL),
    (2, 4, 32, 8, _PREFILL),
    (1, 2, 128, 16, _PREFILL),
    (2, 3, 96, 4, _PREFILL),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("hkv,g,d,bs,rows", SHAPES)
def test_cpu_paged_kernel_matches_reference(dtype, tol, hkv, g, d, bs, rows):
    kernel = get_backend("cpu_paged")
    kernel.kernel = _Recording(kernel.kernel)
    ref = get_backend("reference")
    states, counts = _batch(bs, rows=rows) if rows else _batch(bs)
    batch = build_step_batch(states, counts, bs, "cpu")
    t = batch.input_ids.shape[0]
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, hkv, 7 * 40, bs, d, generator=gen).to(dtype)
    q = torch.randn(t, hkv * g, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    c1, c2 = cache.clone(), cache.clone()
    a = ref.forward(q, k, v, c1, batch.meta, 0.25)
    b = kernel.forward(q, k, v, c2, batch.meta, 0.25)
    assert torch.equal(c1, c2)  # same slot writes
    # Ground truth: the reference in float32 on the same (already rounded) values. In bf16 the
    # reference itself rounds the softmax to bf16, so both are held to the truth, not each other.
    truth = ref.forward(q.float(), k.float(), v.float(), cache.float(), batch.meta, 0.25)
    assert (b.float() - truth).abs().max().item() < tol
    # The prefill op ran where the build has a vector path (AVX-512 or AVX2) and head_dim is a
    # multiple of 32; elsewhere it declined and PyTorch's path ran (and matched, above).
    assert kernel.kernel.prefill_results == [d % 32 == 0 and kernel.kernel.isa() != "generic"]
    if dtype == torch.bfloat16:  # no worse than the reference path
        assert (b.float() - truth).abs().max().item() <= (a.float() - truth).abs().max().item() + 1e-6
