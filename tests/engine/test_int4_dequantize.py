"""The int4 weight widened (int4_dequantize.cpp) for prompt-sized steps: to bf16, bit-equal to the
weight PyTorch's int4 kernel computes with, rounded to bf16 (its (q - 8) * scale is exact in
float32, so one rounding is left), in both pack layouts, for a two-nibble (Q8_0) weight and for
row counts off the pack's blocks; to float32 from the exact scale and min planes (exact mode),
q * scale + min within one float32 rounding; and int4_linear's use of it past CHUNKED_ROWS rows."""

import pytest
import torch
import torch.nn.functional as F

from engine.layers.quant.blocks import BlockQuantized
from engine.layers.quant.int4 import CHUNKED_ROWS, WIDE_ROWS, exact_mode, int4_linear, small_rows, wide_gemm_ops
from engine.layers.quant.int4_format import (
    dequantize_int4,
    pack_int4,
    pack_layout,
    quantize_int4,
    scale_planes,
    unpack_nibbles,
)
from tests.engine.test_int4_small_linear import (
    exact_wide,
    pack_rows,
    pack_rows32,
    pytorch_weight,
    run_op,
    with_f16_scales,
)
from tests.engine.test_small_linear import vector


def widen(ops, w, block_rows=None):
    """The op's [in_features, N] bf16 weight, or None where it declined (then it wrote nothing)."""
    k = w.shape[1] * 2 // (2 if w.two_nibbles else 1)
    out = torch.zeros(k, w.out_features, dtype=torch.bfloat16)
    if ops.int4_dequantize(w, w.scales_zeros_bf16, w.group_size, block_rows or pack_layout()[1], out):
        return out
    assert (out == 0).all()
    return None


@pytest.mark.parametrize("n,k,group", [(100, 64, 32), (960, 576, 64), (130, 1536, 128), (64, 256, 32)])
def test_widened_weight_is_the_kernels_weight_in_bf16(ops, n, k, group):
    g = torch.Generator().manual_seed(n + k)
    w = quantize_int4(torch.randn(n, k, generator=g), group)
    got = widen(ops, w)
    if got is None:
        assert not vector(ops)
        return
    assert torch.equal(got, pytorch_weight(w).t().bfloat16())


def q8_0_weight(seed: int):
    """(q, d, packed): a random Q8_0 weight [160, 576] (float16 scales per 32) as two nibbles."""
    g = torch.Generator().manual_seed(seed)
    n, k = 160, 576
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half().float()
    w = pack_int4(
        *BlockQuantized(q, d, torch.zeros_like(d), bits=8, kind="Q8_0").as_nibbles(split=True), 32, split=True
    )
    return q, d, w


def test_two_nibble_weight_sums_its_halves_before_rounding(ops):
    q, d, w = q8_0_weight(7)
    k = q.shape[1]
    got = widen(ops, w)
    if got is None:
        assert not vector(ops)
        return
    both = pytorch_weight(w)  # [n, 2k]: the hi nibbles' values and the lo ones'
    assert torch.equal(got, (both[:, :k] + both[:, k:]).t().bfloat16())
    # The Q8_0 values q * d, within the kernel's bf16 scales (d is float16) and the bf16 result.
    exact = (q.float() * d.repeat_interleave(32, dim=1)).t()
    assert ((got.float() - exact).abs() <= 2**-7 * exact.abs() + 1e-8).all()


def test_reads_the_32_row_layout(ops):
    w = quantize_int4(torch.randn(96, 128), 32)
    w32 = torch.nn.Parameter(pack_rows32(unpack_nibbles(w.data)), requires_grad=False)
    w32.__dict__.update({a: w.__dict__[a] for a in ("scales_zeros_bf16", "group_size", "two_nibbles", "out_features")})
    got = widen(ops, w32, block_rows=32)
    if got is None:
        assert not vector(ops)
        return
    assert torch.equal(got, pytorch_weight(w).t().bfloat16())


@pytest.mark.parametrize("scales", ["f32", "f16"])
@pytest.mark.parametrize("block_rows", [64, 32])
@pytest.mark.parametrize("n,k,group", [(100, 64, 32), (960, 576, 64), (130, 1536, 128)])
def test_exact_widening_is_q_times_scale_plus_min(ops, n, k, group, block_rows, scales):
    """From the scale and min planes (float32, or float16 as GGUF's): q * scale + min in float32,
    one rounding (an FMA), in both layouts."""
    g = torch.Generator().manual_seed(n + k + block_rows)
    w = quantize_int4(torch.randn(n, k, generator=g), group)
    if scales == "f16":
        w = with_f16_scales(w)
    q = unpack_nibbles(w.data)
    packed = torch.nn.Parameter(pack_rows(q, block_rows), requires_grad=False)
    packed.__dict__.update({a: w.__dict__[a] for a in ("scale_min", "group_size", "two_nibbles", "out_features")})
    w = packed
    out = torch.zeros(k, n)
    if not ops.int4_dequantize(w, w.scale_min, group, block_rows, out):
        assert not vector(ops) and (out == 0).all()
        return
    s, mn = (t.t().double().repeat_interleave(group, dim=1)[:n] for t in scale_planes(w.scale_min))
    prod, ref = q[:n].double() * s, q[:n].double() * s + mn
    bound = 2.0**-24 * (prod.abs() + mn.abs())  # one float32 rounding of the exact sum
    assert ((out.t().double() - ref).abs() <= bound).all()
    if scales == "f16":  # q * scale exact in float32: the FMA's sum rounded once, as in float64
        assert torch.equal(out.t(), ref.float())


def test_exact_widening_of_two_nibbles_is_the_q8_0_values(ops):
    """A Q8_0 weight from its exact planes: 16 hi d - 128 d + lo d = q * d, exactly."""
    q, d, w = q8_0_weight(3)
    n, k = q.shape
    out = torch.zeros(k, n)
    if not ops.int4_dequantize(w, w.scale_min, 32, pack_layout()[1], out):
        assert not vector(ops)
        return
    assert torch.equal(out.t(), q.float() * d.repeat_interleave(32, dim=1))


def test_declines_what_it_does_not_cover(ops):
    w = quantize_int4(torch.randn(64, 64), 32)
    sz = w.scales_zeros_bf16
    cases = [
        (w, sz, 32, 48, torch.empty(64, 64, dtype=torch.bfloat16)),  # no such layout
        (w, sz, 32, 64, torch.empty(64, 64, dtype=torch.float16)),  # neither bf16 nor float32 out
        (w, sz, 32, 64, torch.empty(64, 65, dtype=torch.bfloat16)),  # more rows than packed
        (w, sz, 32, 64, torch.empty(48, 64, dtype=torch.bfloat16)),  # inputs neither k nor 2k
        (w, sz.float(), 32, 64, torch.empty(64, 64, dtype=torch.bfloat16)),  # pairs, not bf16
        (w, w.scale_min.double(), 32, 64, torch.empty(64, 64)),  # planes neither float32 nor float16
        (w, w.scale_min[:, :1], 32, 64, torch.empty(64, 64)),  # planes of another shape
        (w, sz, 64, 64, torch.empty(64, 64, dtype=torch.bfloat16)),  # scales for another group size
    ]
    for packed, scales, group, block, out in cases:
        assert not ops.int4_dequantize(packed, scales, group, block, out)


@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_int4_linear_widens_past_the_chunked_op(ops, xdt, monkeypatch):
    """Up to CHUNKED_ROWS rows int4_linear is the op in chunks of its 64 rows (bit-equal to each
    chunk alone), past them the bf16 GEMM of the widened weight (bit-equal), where the CPU
    multiplies bf16 natively; with ORBITAL_INT4_WIDE_GEMM=0, PyTorch's kernel past small_rows()."""
    w = quantize_int4(torch.randn(200, 256), 64)
    bias = torch.randn(200).to(xdt)
    on = wide_gemm_ops() is not None
    assert on == (
        ops.isa() == "avx512_bf16" and pack_layout() == ("halves", 64) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    for m in (WIDE_ROWS - 1, WIDE_ROWS, CHUNKED_ROWS, CHUNKED_ROWS + 1, 300):
        x = torch.randn(m, 256).to(xdt)
        got = int4_linear(x, w, bias)
        ref = F.linear(x.float(), dequantize_int4(w), bias.float())
        torch.testing.assert_close(got.float(), ref, atol=0.05 * ref.abs().max().item(), rtol=0.02)
        wide = (x.bfloat16() @ widen(ops, w)).to(xdt) + bias if on else None
        assert (on and m > CHUNKED_ROWS) == (wide is not None and torch.equal(got, wide))
        if on and m <= CHUNKED_ROWS:
            chunks = [run_op(ops, c.bfloat16().to(xdt), w, scale_min=w.scales_zeros_bf16) for c in x.split(64)]
            assert torch.equal(got, torch.cat(chunks) + bias)
    monkeypatch.setenv("ORBITAL_INT4_WIDE_GEMM", "0")
    assert wide_gemm_ops() is None
    if (
        exact_mode()
    ):  # exact mode never runs PyTorch's kernel: past the op's chunks, the float32 GEMM of the exact weight
        x = torch.randn(small_rows() + 1, 256).to(xdt)
        chunks = [run_op(ops, c.float(), w) for c in x.split(small_rows())]
        assert torch.equal(int4_linear(x, w, bias), torch.cat(chunks).to(xdt) + bias)
        x = torch.randn(CHUNKED_ROWS + 1, 256).to(xdt)
        assert torch.equal(int4_linear(x, w, bias), torch.mm(x.float(), exact_wide(ops, w)).to(xdt) + bias)
        return
    x = torch.randn(WIDE_ROWS, 256).to(xdt)
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), w, 64, w.scales_zeros_bf16)[:, :200]
    assert torch.equal(int4_linear(x, w, bias), kernel.to(xdt) + bias)


def test_an_int8_weight_with_float32_activations_stays_a_float32_gemm(ops):
    """An int8 weight in the two-nibble pack (apply.int8_as_nibbles): widened to float32 it is
    exactly q * its bf16 scale, and prompt-sized float32 rows multiply it in float32 (the int8
    path's precision), not through the bf16 GEMM."""
    from engine.layers.quant import QuantSpec
    from engine.layers.quant.apply import quantize_param
    from engine.layers.quant.int8 import quantize_int8

    g = torch.Generator().manual_seed(11)
    w = torch.randn(200, 576, generator=g) * 0.05
    q8 = quantize_int8(w)
    packed = quantize_param(w, QuantSpec("int8"))
    if packed.dtype == torch.int8:  # no int4 op here: int8.py's kernels run it
        assert not vector(ops) or pack_layout()[0] != "halves"
        return
    exact = q8.data.float() * q8.scale_bf16.float()[:, None]
    wide = torch.empty(576, 200)
    assert ops.int4_dequantize(packed, packed.scales_zeros_bf16, packed.group_size, pack_layout()[1], wide)
    assert torch.equal(wide, exact.t())
    bias = torch.randn(200, generator=g)
    x = torch.randn(WIDE_ROWS + 9, 576, generator=g)
    if exact_mode():  # float32 sums of the exact weight through the op, in chunks of its rows
        want = torch.cat([run_op(ops, c, packed) for c in x.split(small_rows())])
    else:
        want = torch.mm(x, exact.t())
    assert torch.equal(int4_linear(x, packed, bias), want + bias)
