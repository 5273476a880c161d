"""The int8 KV cache's rows (per-token, per-head float16 scale) and the C++ ops that write and
read them, against the PyTorch reference backend reading the same cache."""

from __future__ import annotations

import pytest
import torch

from engine.layers.attention.kv_quant import dequantize_rows, quantize_rows, round_trip
from engine.layers.attention.selector import get_backend
from engine.runner.attn_metadata_builder import build_step_batch
from tests.engine.test_attention_backends import SHAPES, _batch, _Recording


def test_rows_round_trip_within_half_a_step_and_keep_zeros():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 64, generator=g) * torch.logspace(-3, 3, 64).view(64, 1, 1)
    x[5, 1] = 0.0  # an all-zero row: scale 0, values 0, no NaN
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (64, 3, 66)
    back = dequantize_rows(rows, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    # half a quantization step, plus the float16 rounding of the scale (2^-11 relative) at 127
    assert ((back - x).abs() <= step * (0.5 + 127 * 2**-11) + 1e-12).all()
    assert torch.equal(back[5, 1], torch.zeros(64))
    assert torch.equal(round_trip(x), back)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hkv,g,d,bs,rows", SHAPES)
def test_cpu_ops_read_and_write_the_int8_cache_as_the_reference_does(dtype, tol, hkv, g, d, bs, rows):
    kernel = get_backend("cpu_paged")
    kernel.kernel = _Recording(kernel.kernel)
    ref = get_backend("reference")
    states, counts = _batch(bs, rows=rows) if rows else _batch(bs)
    batch = build_step_batch(states, counts, bs, "cpu")
    t = batch.input_ids.shape[0]
    gen = torch.Generator().manual_seed(1)
    cache = quantize_rows(torch.randn(2, hkv, 7 * 40, bs, d, generator=gen))
    q = torch.randn(t, hkv * g, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    c1, c2 = cache.clone(), cache.clone()
    a = ref.forward(q, k, v, c1, batch.meta, 0.25)
    b = kernel.forward(q, k, v, c2, batch.meta, 0.25)
    # The C++ write quantizes as quantize_rows does (a rounding tie may land one step apart).
    diff = (c1.float() - c2.float()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-4
    # Ground truth: the reference in float32 over the kernel's own cache.
    truth = ref.forward(q.float(), k.float(), v.float(), c2.clone(), batch.meta, 0.25)
    assert (b.float() - truth).abs().max().item() < tol
    assert (a.float() - truth).abs().max().item() < tol + 1e-2
    assert kernel.kernel.prefill_results == [d % 32 == 0 and kernel.kernel.isa() != "generic"]
