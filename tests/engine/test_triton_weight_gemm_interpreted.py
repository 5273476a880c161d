"""The Triton weight-only GEMMs (int4 plain rows with group scales and mins, the two-nibble form
of 8-bit GGUF blocks, int8 with per-channel scales) against F.linear of the float weights they
stand for, on CPU through Triton's interpreter: indexing, masks, tiles for few and many rows and
the scale/min algebra are checked without a GPU wherever `triton` imports (CPU CI has no Triton
and skips with the reason; test_gpu_quantization.py runs them compiled)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel module is imported
triton = pytest.importorskip("triton", reason="the triton package is not installed")

from engine.layers.quant.blocks import BlockQuantized  # noqa: E402
from engine.layers.quant.cuda_int4 import embedding_int4_cuda, int4_linear_cuda, pack_int4_cuda  # noqa: E402
from engine.layers.quant.int4_format import dequantize_groups, quantize_groups  # noqa: E402
from engine.layers.quant.int8 import quantize_int8  # noqa: E402
from engine.layers.quant.triton_tiles import Tile  # noqa: E402
from engine.layers.quant.triton_weight_gemm import int4_matmul, int8_matmul  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the GPU tests run the compiled kernels")


def _pairs(q: torch.Tensor) -> torch.Tensor:
    q = q.to(torch.uint8)
    return (q[:, ::2] << 4 | q[:, 1::2]).contiguous()


def _interpreter_works() -> bool:
    # Triton 3.6's interpreter turns 1-element arrays into ints, which numpy >= 2.4 refuses.
    q, s, lo = quantize_groups(torch.randn(16, 32), 32)
    try:
        int4_matmul(torch.randn(1, 32), _pairs(q), torch.stack([s.t(), lo.t()]).contiguous(), 32, 16)
    except triton.runtime.errors.InterpreterError:
        return False
    return True


@pytest.fixture(autouse=True)
def _needs_interpreter():
    if not _interpreter_works():
        pytest.skip("Triton's interpreter does not run with this numpy")


@pytest.mark.parametrize("rows", [1, 5, 40, 70])
@pytest.mark.parametrize(
    "group,n,k", [(32, 100, 96), (64, 48, 128), (128, 33, 256), (32, 16, 1024), (64, 16, 576)]
)  # the last two: few outputs, many inputs, split across programs (evenly, and 9 steps in 3)
def test_int4_rows_match_their_float_weight(rows, group, n, k):
    torch.manual_seed(rows + group)
    w = torch.randn(n, k) * 0.05
    q, s, lo = quantize_groups(w, group)
    scale_min = torch.stack([s.t(), lo.t()]).contiguous()
    w_q = dequantize_groups(q, scale_min, group, False, torch.float32)
    x, bias = torch.randn(rows, k), torch.randn(n)
    got = int4_matmul(x, _pairs(q), scale_min, group, n, bias)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w_q, bias), atol=1e-4, rtol=1e-4)


def test_centered_planes_take_zero_points():
    """Planes of scale and zero point z = min + 8 s (`centered`) give the same weight."""
    torch.manual_seed(3)
    q, s, lo = quantize_groups(torch.randn(40, 128), 32)
    x = torch.randn(5, 128)
    want = int4_matmul(x, _pairs(q), torch.stack([s.t(), lo.t()]).contiguous(), 32, 40)
    got = int4_matmul(x, _pairs(q), torch.stack([s.t(), (lo + 8 * s).t()]).contiguous(), 32, 40, centered=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [3, 66])
def test_two_nibble_8bit_blocks_read_x_twice(rows):
    """Q8_0-like blocks as [hi | lo] nibble halves (K' = 2K): the kernel reads input k mod K."""
    torch.manual_seed(rows)
    n, k = 40, 64
    blk = BlockQuantized(
        torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n, k // 32) * 0.01, torch.zeros(n, k // 32), 8
    )
    q, s, lo = blk.as_nibbles(split=True)
    scale_min = torch.stack([s.t(), lo.t()]).contiguous()
    x = torch.randn(rows, k)
    got = int4_matmul(x, _pairs(q), scale_min, 32, n)
    torch.testing.assert_close(got, F.linear(x, blk.dequantize()), atol=1e-4, rtol=1e-4)


def test_cuda_int4_plain_rows_pack_linear_and_embedding_lookup(monkeypatch):
    """cuda_int4's "triton" form (what the engine packs on CUDA), run here on CPU tensors: the
    linear through the kernel and the lookup from the same bytes give the dequantized weight's
    values, for a plain and a two-nibble weight; scales are kept float16 where exact."""
    monkeypatch.setenv("ORBITAL_CUDA_QUANT_KERNEL", "triton")
    torch.manual_seed(2)
    n, k = 48, 64
    blk = BlockQuantized(
        torch.randint(-128, 128, (n, k), dtype=torch.int8),
        torch.rand(n, k // 32).half().float(),
        torch.zeros(n, k // 32),
        8,
    )
    for split in (False, True):
        if split:
            q, s, lo = blk.as_nibbles(split=True)
            w = blk.dequantize()
        else:
            q, s, lo = quantize_groups(torch.randn(n, k), 32)
            w = dequantize_groups(q, torch.stack([s.t(), lo.t()]), 32, False, torch.float32)
        packed = pack_int4_cuda(q, s, lo, 32, split=split, keep_rows=True)
        assert packed.dtype == torch.uint8 and packed.shape == (n, q.shape[1] // 2) and packed.rows is None
        assert packed.scale_min.dtype == (torch.float16 if split else torch.bfloat16) and packed.centered != split
        planes = packed.scale_min.float()
        if packed.centered:  # scale and zero point z = min + 8 s
            planes = torch.stack([planes[0], planes[1] - 8 * planes[0]])
        w_stored = dequantize_groups(q, planes, 32, split, torch.float32)  # scales as stored
        torch.testing.assert_close(w_stored, w, atol=2e-2, rtol=1e-2)
        x = torch.randn(3, k)
        torch.testing.assert_close(int4_linear_cuda(x, packed), F.linear(x, w_stored), atol=1e-4, rtol=1e-4)
        ids = torch.tensor([[0, 7], [47, 7]])
        torch.testing.assert_close(embedding_int4_cuda(packed, ids, torch.float32), w_stored[ids])


def test_int4_padded_rows_beyond_out_features_are_not_written():
    """A weight with more stored rows than outputs (a padded shard): only out_features come back."""
    torch.manual_seed(1)
    q, s, lo = quantize_groups(torch.randn(24, 64), 32)
    scale_min = torch.stack([s.t(), lo.t()]).contiguous()
    x = torch.randn(2, 64)
    got = int4_matmul(x, _pairs(q), scale_min, 32, 20)
    want = F.linear(x, dequantize_groups(q, scale_min, 32, False, torch.float32))[:, :20]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 17, 70])
@pytest.mark.parametrize("n,k", [(50, 96), (130, 200), (16, 1000)])
def test_int8_rows_match_their_float_weight(rows, n, k):
    torch.manual_seed(rows + n)
    q = quantize_int8(torch.randn(n, k) * 0.05)
    x, bias = torch.randn(rows, k), torch.randn(n)
    got = int8_matmul(x, q, q.scale, bias)
    torch.testing.assert_close(got, F.linear(x, q.float() * q.scale[:, None], bias), atol=1e-4, rtol=1e-4)


def test_leading_dims_and_empty_batches():
    q = quantize_int8(torch.randn(32, 64))
    x = torch.randn(2, 3, 64)
    assert int8_matmul(x, q, q.scale).shape == (2, 3, 32)
    assert int8_matmul(torch.randn(0, 64), q, q.scale).shape == (0, 32)


@pytest.mark.parametrize(
    "tile", [Tile(16, 32, 256), Tile(16, 128, 128, split=False), Tile(32, 64, 64), Tile(128, 128, 128, 8)]
)
def test_tuner_candidate_tiles_compute_the_same(tile):
    """Tiles the tuner may pick (bench/bench_gpu_quant_kernels.py): steps wider than a group,
    narrow and wide columns, no split, big row tiles."""
    torch.manual_seed(4)
    q, s, lo = quantize_groups(torch.randn(80, 512), 32)
    scale_min = torch.stack([s.t(), lo.t()]).contiguous()
    x = torch.randn(20, 512)
    want = F.linear(x, dequantize_groups(q, scale_min, 32, False, torch.float32))
    torch.testing.assert_close(int4_matmul(x, _pairs(q), scale_min, 32, 80, tile=tile), want, atol=1e-4, rtol=1e-4)
    q8 = quantize_int8(torch.randn(80, 500))
    want8 = F.linear(x[:, :500].contiguous(), q8.float() * q8.scale[:, None])
    torch.testing.assert_close(
        int8_matmul(x[:, :500].contiguous(), q8, q8.scale, tile=tile), want8, atol=1e-4, rtol=1e-4
    )
