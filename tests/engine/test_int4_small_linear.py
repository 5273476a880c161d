"""The few-row int4 C++ linear (int4_linear.cpp) against dequantize + F.linear (exact scales, and
PyTorch's bf16 ones as int4_linear passes them), and its use by int4_linear.

Tolerance: the op sums in float32 in another order than the reference (float64 over the same
dequantized weight), so |out - ref| <= 1e-5 * sum_k |x_k * w_nk| (float32 rounding over up to
3072 products, with room); bfloat16 outputs also round once: + 2^-8 * |ref|.
"""

import pytest
import torch
import torch.nn.functional as F

from engine.layers.quant import QuantSpec
from engine.layers.quant.apply import quantize_param
from engine.layers.quant.blocks import BlockQuantized
from engine.layers.quant.int4 import (
    EXACT_ROWS,
    SMALL_ROWS,
    WIDE_ROWS,
    exact_mode,
    int4_linear,
    int4_logits,
    op_pairs,
    small_linear_ops,
    small_rows,
    wide_gemm_ops,
)
from engine.layers.quant.int4_format import (
    dequantize_int4,
    pack_int4,
    pack_layout,
    quantize_int4,
    scale_planes,
    unpack_nibbles,
    weight_values,
)
from engine.layers.quant.int8 import quantize_int8
from tests.engine.test_small_linear import vector


def run_op(ops, x, w, bias=None, block_rows=None, scale_min=None):
    """The op's output, or None where it declined (then it wrote nothing)."""
    out = torch.full((x.shape[0], w.out_features), float("nan"), dtype=x.dtype)
    sm = w.scale_min if scale_min is None else scale_min
    hb = getattr(w, "hi_bits", None)  # a 5-bit weight's high bits (test_int4_five_bits.py)
    if ops.int4_small_linear(x, w, sm, w.group_size, block_rows or pack_layout()[1], bias, out, hb):
        return out
    assert out.isnan().all()
    return None


def assert_matches(out, x, w_float, bias, extra=0.0):
    ref = F.linear(x.double(), w_float.double(), None if bias is None else bias.double())
    bound = 1e-5 * (x.double().abs() @ w_float.double().abs().t()) + 1e-6 + extra
    if out.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * ref.abs()
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), (err - bound).max().item()


def with_f16_scales(w):
    """The same weight with its scales and mins rounded to float16 (as GGUF's are): stored so."""
    n = w.out_features
    q = unpack_nibbles(w.data)[:n]
    scale, minimum = (t.t()[:n].half().float() for t in scale_planes(w.scale_min))
    return pack_int4(q, scale, minimum, w.group_size)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 16, 41, 64])  # 7 on: chunks of 4 rows over each block
@pytest.mark.parametrize(
    "n,k,group", [(100, 64, 32), (100, 64, 64), (960, 576, 32), (960, 576, 64), (100, 1536, 64), (100, 1536, 128)]
)
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", ["f32", "f16"])
def test_op_matches_dequantized_float32(ops, m, n, k, group, xdt, scales):
    g = torch.Generator().manual_seed(m * 100 + group + k)
    w = quantize_int4(torch.randn(n, k, generator=g) * torch.linspace(0.1, 2.0, n)[:, None], group)
    if scales == "f16":
        w = with_f16_scales(w)
    assert w.scale_min.dtype == (torch.float16 if scales == "f16" else torch.float32)
    x = torch.randn(m, k, generator=g).to(xdt)
    bias = torch.randn(n, generator=g).to(xdt) if m % 2 else None
    out = run_op(ops, x, w, bias)
    if out is None:
        assert not vector(ops)
        return
    assert vector(ops)
    assert_matches(out, x, dequantize_int4(w), bias)


@pytest.mark.parametrize("m", [1, 4, 9])
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_op_two_nibbles_q8_0(ops, m, xdt):
    """A Q8_0 weight as two nibbles (K' = 2 * in_features): the op reads x twice over."""
    g = torch.Generator().manual_seed(m)
    n, k = 160, 576
    blocks, w = q8_0_two_nibbles(n, k, g)
    assert w.two_nibbles and w.shape == (192, k) and w.scale_min.dtype == torch.float16
    x = torch.randn(m, k, generator=g).to(xdt)
    out = run_op(ops, x, w)
    if out is None:
        assert not vector(ops)
        return
    assert_matches(out, x, blocks.dequantize(), None)


def q8_0_two_nibbles(n: int, k: int, g: torch.Generator) -> tuple[BlockQuantized, torch.Tensor]:
    """Random Q8_0 blocks (float16 scales per 32 inputs) and their two-nibble pack."""
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half().float()
    blocks = BlockQuantized(q, d, torch.zeros_like(d), bits=8, kind="Q8_0")
    return blocks, pack_int4(*blocks.as_nibbles(split=True), 32, split=True)


def pytorch_weight(w):
    """The weight PyTorch's kernel computes with: (q - 8) * scale + zero, both rounded to bf16
    (q 0..15, or 0..31 with a 5-bit weight's high bits)."""
    q = weight_values(w).float()
    n, k = q.shape
    sz = w.scales_zeros_bf16.float()
    s, z = sz[..., 0].t(), sz[..., 1].t()
    g = w.group_size
    return ((q.view(n, k // g, g) - 8) * s[..., None] + z[..., None]).view(n, k)[: w.out_features]


@pytest.mark.parametrize("m", [1, 2, 4, 13])
@pytest.mark.parametrize("n,k,group", [(100, 64, 32), (960, 576, 64), (100, 1536, 128)])
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_op_with_pytorch_scales_matches_its_weight(ops, m, n, k, group, xdt):
    """Given PyTorch's bf16 (scale, zero) pairs, the op computes with PyTorch's kernel's weight
    (what int4_linear passes it); with bf16 x, the kernel's result within rounding."""
    g = torch.Generator().manual_seed(m + k)
    w = quantize_int4(torch.randn(n, k, generator=g), group)
    x = torch.randn(m, k, generator=g).to(xdt)
    out = run_op(ops, x, w, scale_min=w.scales_zeros_bf16)
    if out is None:
        assert not vector(ops)
        return
    assert_matches(out, x, pytorch_weight(w), None)
    if xdt == torch.bfloat16:
        kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, group, w.scales_zeros_bf16)[:, :n]
        assert_matches(kernel, x, pytorch_weight(w), None)


def pack_rows(q: torch.Tensor, rows: int) -> torch.Tensor:
    """PyTorch's pack as its vector code lays it out (64 rows: AVX-512, 32: AVX2): per block of
    `rows` rows and per k, rows / 2 bytes; byte j holds row j (low nibble) and row j + rows / 2."""
    n, k = q.shape
    b = q.view(n // rows, 2, rows // 2, k)
    return (b[:, 0] | b[:, 1] << 4).transpose(1, 2).contiguous().view(n, k // 2)


def pack_rows32(q: torch.Tensor) -> torch.Tensor:
    return pack_rows(q, 32)


@pytest.mark.parametrize("m", [1, 3, 6])
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_op_reads_the_32_row_layout(ops, m, xdt):
    w = quantize_int4(torch.randn(96, 128), 32)
    x = torch.randn(m, 128).to(xdt)
    w32 = torch.nn.Parameter(pack_rows32(unpack_nibbles(w.data)), requires_grad=False)
    w32.__dict__.update({a: w.__dict__[a] for a in ("scale_min", "group_size", "two_nibbles", "out_features")})
    out = run_op(ops, x, w32, block_rows=32)
    if out is None:
        assert not vector(ops)
        return
    assert_matches(out, x, dequantize_int4(w), None)


def test_op_declines_what_it_does_not_cover(ops):
    w = quantize_int4(torch.randn(64, 64), 32)
    x = torch.randn(1, 64)
    sm = w.scale_min
    for xx, block, scale_min, out in [
        (torch.randn(65, 64), 64, sm, torch.empty(65, 64)),  # more rows than the op takes
        (torch.randn(1, 48), 64, sm, torch.empty(1, 64)),  # inputs match neither K' nor K' / 2
        (x, 48, sm, torch.empty(1, 64)),  # no such layout
        (x, 64, sm[:, :1], torch.empty(1, 64)),  # scales of another shape
        (x, 64, sm.double(), torch.empty(1, 64)),
        (x, 64, sm, torch.empty(1, 65)),  # more outputs than rows
        (x, 64, sm, torch.empty(1, 64).bfloat16()),  # out not in x's dtype
        (x.double(), 64, sm, torch.empty(1, 64).double()),
    ]:
        assert not ops.int4_small_linear(xx, w, scale_min, 32, block, None, out)
    assert not ops.int4_small_linear(x, w, sm, 32, 64, torch.randn(64).bfloat16(), torch.empty(1, 64))


def exact_wide(ops, w):
    """The weight widened exactly to float32 [in_features, N] from its scale and min planes."""
    k = w.shape[1] * 2 // (2 if w.two_nibbles else 1)
    wide = torch.empty(k, w.out_features)
    assert ops.int4_dequantize(w, w.scale_min, w.group_size, pack_layout()[1], wide)
    return wide


@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_int4_linear_takes_the_op_at_few_rows(ops, xdt, monkeypatch):
    """Up to small_rows() rows int4_linear is the op (bit-equal); in exact mode (no native bf16)
    the op gets x unrounded and the exact scales, more rows go through it in chunks of its rows
    (bit-equal), never through PyTorch's bf16 kernel."""
    w = quantize_int4(torch.randn(100, 128), 32)
    bias = torch.randn(100).to(xdt)
    on = small_linear_ops() is not None
    assert on == (vector(ops) and pack_layout()[0] == "halves")  # both vector layouts of PyTorch's pack
    exact = exact_mode()
    assert exact == (on and wide_gemm_ops() is None)
    limit = small_rows()
    assert limit == (WIDE_ROWS - 1 if wide_gemm_ops() is not None else EXACT_ROWS if exact else SMALL_ROWS)
    for m in (1, limit, limit + 1, 40):
        x = torch.randn(m, 128).to(xdt)
        got = int4_linear(x, w, bias)
        ref = F.linear(x.float(), dequantize_int4(w), bias.float())
        torch.testing.assert_close(got.float(), ref, atol=0.05 * ref.abs().max().item(), rtol=0.02)
        if exact:
            # past the op's own rows, in chunks of them (up to CHUNKED_ROWS: test_int4_dequantize)
            direct = torch.cat([run_op(ops, c.float(), w) for c in x.split(limit)])
            assert torch.equal(got, direct.to(xdt) + bias)
        elif on and m <= limit:  # bit-equal to the op: it ran, not PyTorch's kernel
            direct = run_op(ops, x.bfloat16().to(xdt), w, scale_min=w.scales_zeros_bf16) + bias
            assert torch.equal(got, direct)
    x3 = torch.randn(2, 1, 128).to(xdt)  # leading dims are kept
    assert int4_linear(x3, w, bias).shape == (2, 1, 100)
    monkeypatch.setenv("ORBITAL_INT4_SMALL_LINEAR", "0")
    assert small_linear_ops() is None and not exact_mode()


@pytest.mark.parametrize("block_rows", [64, 32])
@pytest.mark.parametrize("scales", ["pairs", "exact"])
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(ops, xdt, scales, block_rows):
    """Batching and preemption's recompute rely on it: 50 rows at once (13 chunks) and smaller
    counts equal each row alone, bit for bit, with PyTorch's bf16 pairs and with the exact
    scales, in both layouts."""
    g = torch.Generator().manual_seed(5)
    w = quantize_int4(torch.randn(200, 576, generator=g), 32)
    packed = torch.nn.Parameter(pack_rows(unpack_nibbles(w.data), block_rows), requires_grad=False)
    packed.__dict__.update({a: w.__dict__[a] for a in ("scale_min", "group_size", "two_nibbles", "out_features")})
    sm = w.scales_zeros_bf16 if scales == "pairs" else w.scale_min
    x = torch.randn(50, 576, generator=g).to(xdt)
    together = run_op(ops, x, packed, block_rows=block_rows, scale_min=sm)
    if together is None:
        assert not vector(ops)
        return
    alone = torch.cat([run_op(ops, x[i : i + 1], packed, block_rows=block_rows, scale_min=sm) for i in range(50)])
    assert torch.equal(together, alone)
    for m in (2, 3, 5, 6, 7, 9, 13):
        assert torch.equal(run_op(ops, x[:m], packed, block_rows=block_rows, scale_min=sm), alone[:m])


def test_an_8bit_head_keeps_float32_logits_where_the_op_runs(ops):
    """An int8 weight (an LM head here) goes into the two-nibble pack (its int8 values exactly)
    where the op runs; its logits are then float32 sums at every row count, chunked through the op, equal
    row by row to the op alone (PyTorch's int8 kernel rounds them to bf16). Elsewhere the head
    stays int8."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(320, 576, generator=g) * 0.05
    head = quantize_param(w, QuantSpec("int8"))
    q8 = quantize_int8(w)
    if small_linear_ops() is None:
        assert head.dtype == torch.int8
        return
    assert head.dtype == torch.uint8 and head.two_nibbles
    exact = q8.data.float() * q8.scale[:, None]
    torch.testing.assert_close(dequantize_int4(head), exact, rtol=0, atol=1e-7)
    wb = q8.data.float() * q8.scale_bf16.float()[:, None]  # what both kernels compute with
    for m in (1, 7, small_rows(), small_rows() + 1, 150):
        x = torch.randn(m, 576, generator=g)
        y = int4_logits(x, head)
        xr = x if exact_mode() else x.bfloat16()  # exact mode: x as it is
        ref = (xr.double() @ wb.double().t()).float()
        assert y.dtype == torch.float32 and y.shape == (m, 320)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        assert not torch.equal(y, y.bfloat16().float())  # not rounded to bf16
        assert torch.equal(y[-1:], int4_logits(x[-1:], head))  # a row's logits alone


@pytest.mark.parametrize("block_rows", [64, 32])
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_pairs_blocked_by_64_rows_give_the_same_output(ops, xdt, block_rows):
    """int4_linear hands the op PyTorch's bf16 pairs blocked by 64 rows (op_pairs: its layout
    read a group's pairs from another page each time); the op's output is the one it gives with
    the pairs in PyTorch's layout, bit for bit, at every row count and for an 8-bit (two-nibble)
    weight too."""
    g = torch.Generator().manual_seed(11)
    weights = [
        quantize_int4(torch.randn(200, 576, generator=g), 32),
        quantize_param(torch.randn(130, 576, generator=g) * 0.05, QuantSpec("int8")),
    ]
    for w in weights:
        if w.dtype != torch.uint8:  # no op here: the head stays int8
            assert small_linear_ops() is None
            return
        packed = torch.nn.Parameter(pack_rows(unpack_nibbles(w.data), block_rows), requires_grad=False)
        packed.__dict__.update(
            {a: w.__dict__[a] for a in ("scales_zeros_bf16", "group_size", "two_nibbles", "out_features")}
        )
        blocked = op_pairs(packed)
        groups, rows, _ = w.scales_zeros_bf16.shape
        assert blocked.shape == (rows // 64, groups, 64, 2)
        assert op_pairs(packed) is blocked  # made once
        for m in (1, 3, 4, 7, 33):
            x = torch.randn(m, 576, generator=g).to(xdt)
            theirs = run_op(ops, x, packed, block_rows=block_rows, scale_min=packed.scales_zeros_bf16)
            if theirs is None:
                assert not vector(ops)
                return
            assert torch.equal(run_op(ops, x, packed, block_rows=block_rows, scale_min=blocked), theirs)
