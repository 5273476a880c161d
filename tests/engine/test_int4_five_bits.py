"""5-bit weights (GGUF's Q5_0, Q5_1, Q5_K) as low nibbles plus a plane of high bits
(int4_format.py `.hi_bits`): packed from GGUF blocks where the C++ ops run them, read by the
few-row op (float32 and bf16 dot-product paths, both pack layouts), the widening for prompt-sized
steps, the embedding lookup and the Python dequantization, each against the exact values
q * scale + min. Tolerances as in test_int4_small_linear.py (float32 sums in another order;
bf16 outputs round once more)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.quant import QuantSpec, quantize_param
from engine.layers.quant.blocks import BlockQuantized
from engine.layers.quant.int4 import exact_mode, five_bit_runs, int4_linear, small_rows
from engine.layers.quant.int4_format import (
    dequantize_int4,
    embedding_int4,
    pack_hi_bits,
    pack_int4,
    pack_layout,
    unpack_hi_bits,
    weight_values,
)
from engine.layers.weight_utils import copy_rows_into
from tests.engine.test_int4_small_linear import assert_matches, pack_rows, pytorch_weight, run_op
from tests.engine.test_small_linear import vector


def _q5_0(n: int, k: int, seed: int) -> BlockQuantized:
    """A Q5_0-like weight: q in -16..15, float16 scales per 32 inputs, no min (d * q)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-16, 16, (n, k), generator=g, dtype=torch.int8)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    return BlockQuantized(q, d, torch.zeros_like(d), bits=8, kind="Q5_0")


def _five_bit(blocks: BlockQuantized) -> torch.nn.Parameter:
    nibbles, hi_bits, scale, minimum = blocks.as_five_bits()
    return pack_int4(nibbles, scale, minimum, blocks.group, hi_bits=hi_bits)


def test_the_bit_plane_and_the_values_round_trip():
    blocks = _q5_0(100, 576, 0)
    w = _five_bit(blocks)
    assert w.hi_bits is not None and not w.two_nibbles and w.shape == (128, 288)
    rows = pack_layout()[1]
    assert w.hi_bits.shape == (128 // rows, 576, rows // 8) and w.hi_bits.dtype == torch.uint8
    assert torch.equal(weight_values(w)[:100], (blocks.q.to(torch.int16) + 16).to(torch.uint8))
    assert torch.equal(dequantize_int4(w), blocks.dequantize())  # q' * d + (-16 d) = q * d exactly
    ids = torch.tensor([[0, 63], [64, 99]])
    assert torch.equal(embedding_int4(w, ids, torch.float32), blocks.dequantize()[ids])
    bits = torch.randint(0, 2, (96, 40), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    for r in (32, 96):
        assert torch.equal(unpack_hi_bits(pack_hi_bits(bits, r)), bits)
    # bit r of a block's bytes at input k is row r's
    one = torch.zeros(64, 8, dtype=torch.uint8)
    one[13, 5] = 1
    assert pack_hi_bits(one, 64)[0, 5].tolist() == [0, 1 << 5, 0, 0, 0, 0, 0, 0]


def test_rows_spanning_more_than_32_values_or_an_inexact_min_stay_two_nibbles():
    q8 = BlockQuantized(torch.tensor([[-100] + [0] * 31]).to(torch.int8), torch.ones(1, 1), torch.zeros(1, 1), 8)
    assert q8.as_five_bits() is None
    # a min that q' = q - lo would have to shift by lo * scale, where that sum rounds in float32
    odd = BlockQuantized(
        torch.tensor([[3] + [4] * 31]).to(torch.int8), torch.tensor([[1.0 + 2**-20]]), torch.tensor([[2.0**24]]), 8
    )
    assert odd.as_five_bits() is None
    four = BlockQuantized(torch.randint(0, 16, (2, 32), dtype=torch.uint8), torch.ones(2, 1), torch.zeros(2, 1), 4)
    assert four.as_five_bits() is None  # 4-bit values are nibbles already


@pytest.mark.parametrize("m", [1, 2, 4, 7, 16, 41, 64])
@pytest.mark.parametrize("n,k", [(100, 576), (960, 576), (64, 1536)])
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", ["exact", "pairs"])
def test_op_matches_the_exact_weight(ops, m, n, k, xdt, scales):
    blocks = _q5_0(n, k, m + n)
    w = _five_bit(blocks)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(xdt)
    sm = w.scales_zeros_bf16 if scales == "pairs" else None
    out = run_op(ops, x, w, scale_min=sm)
    if not vector(ops):
        assert out is None
        return
    assert_matches(out, x, blocks.dequantize() if scales == "exact" else pytorch_weight(w), None)


@pytest.mark.parametrize("block_rows", [64, 32])
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_both_pack_layouts_and_a_rows_result_alone(ops, block_rows, xdt):
    """The 32-row (AVX2) and 64-row layouts, with a bias; 50 rows at once equal each row alone."""
    blocks = _q5_0(200, 576, block_rows)
    w = _five_bit(blocks)
    q = weight_values(w)
    packed = torch.nn.Parameter(pack_rows(q & 15, block_rows), requires_grad=False)
    hb = pack_hi_bits(q >> 4, block_rows)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, 576, generator=g).to(xdt)
    bias = torch.randn(200, generator=g).to(xdt)

    def op(rows):
        out = torch.empty(rows.shape[0], 200, dtype=xdt)
        ok = ops.int4_small_linear(rows, packed, w.scale_min, 32, block_rows, bias, out, hb)
        return out if ok else None

    together = op(x)
    if together is None:
        assert not vector(ops)
        return
    assert_matches(together, x, blocks.dequantize(), bias)
    assert torch.equal(together, torch.cat([op(x[i : i + 1]) for i in range(50)]))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", ["exact", "pairs"])
def test_widening_for_prompt_steps(ops, out_dtype, scales):
    blocks = _q5_0(100, 576, 7)
    w = _five_bit(blocks)
    sz = w.scale_min if scales == "exact" else w.scales_zeros_bf16
    wide = torch.empty(576, 100, dtype=out_dtype)
    if not ops.int4_dequantize(w, sz, 32, pack_layout()[1], wide, w.hi_bits):
        assert not vector(ops)
        return
    want = blocks.dequantize() if scales == "exact" else pytorch_weight(w)
    assert torch.equal(wide.t(), want.to(out_dtype))  # one rounding, to out's dtype, of a float32 value


def test_the_op_refuses_a_bit_plane_of_another_shape_or_beside_two_nibbles(ops):
    w = _five_bit(_q5_0(64, 64, 1))
    x, out = torch.randn(1, 64), torch.empty(1, 64)
    for hb in (w.hi_bits[:, :32], w.hi_bits.int(), w.hi_bits.transpose(1, 2)):
        assert not ops.int4_small_linear(x, w, w.scale_min, 32, pack_layout()[1], None, out, hb)
        assert not ops.int4_dequantize(w, w.scale_min, 32, pack_layout()[1], torch.empty(64, 64), hb)
    blocks = _q5_0(64, 64, 2)
    two = pack_int4(*blocks.as_nibbles(True), 32, split=True)
    assert not ops.int4_small_linear(x, two, two.scale_min, 32, pack_layout()[1], None, out, w.hi_bits)


def test_gguf_blocks_are_packed_5_bit_where_the_ops_run_them():
    """quantize_param: Q5_0 rows beside Q5_1-like rows (0..31) in one parameter take the bit
    plane where five_bit_runs(); a Q8_0 piece beside them keeps two nibbles.
    int4_linear at decode and prompt row counts computes the exact weight."""
    a = _q5_0(96, 576, 4)
    g = torch.Generator().manual_seed(5)
    d = (torch.rand(64, 18, generator=g) * 0.02).half().float()
    b = BlockQuantized(torch.randint(0, 32, (64, 576), generator=g).to(torch.int8), d, -8 * d, 8, "Q5_1")
    param = torch.nn.Parameter(torch.empty(160, 576), requires_grad=False)
    copy_rows_into(param, 0, a)
    copy_rows_into(param, 96, b)
    w = quantize_param(param, QuantSpec("gguf"))
    exact = torch.cat([a.dequantize(), b.dequantize()])
    assert torch.equal(dequantize_int4(w), exact)
    assert (w.hi_bits is not None) == five_bit_runs() and w.two_nibbles == (not five_bit_runs())
    for m in (1, small_rows(), 70):
        x = torch.randn(m, 576, generator=g)
        ref = x.double() @ exact.double().t()
        got = int4_linear(x, w).double()
        if exact_mode():  # float32 sums of exact products
            assert ((got - ref).abs() <= 1e-5 * (x.double().abs() @ exact.double().abs().t()) + 1e-6).all()
        else:  # bf16 activations (the int4 bound of test_gguf_kquants)
            assert ((got - ref).norm() / ref.norm()).item() < 0.01
    q8 = BlockQuantized(torch.randint(-128, 128, (64, 576), generator=g).to(torch.int8), d, torch.zeros_like(d), 8)
    mixed = torch.nn.Parameter(torch.empty(160, 576), requires_grad=False)
    copy_rows_into(mixed, 0, a)
    copy_rows_into(mixed, 96, q8)
    w = quantize_param(mixed, QuantSpec("gguf"))
    assert w.hi_bits is None and w.two_nibbles
    assert torch.equal(dequantize_int4(w), torch.cat([a.dequantize(), q8.dequantize()]))


def test_a_linear_through_int4_linear_equals_the_op(ops):
    """int4_linear hands the bit plane to the op (bit-equal to calling it directly)."""
    if not five_bit_runs():
        pytest.skip("the C++ int4 ops do not run here: GGUF's 5-bit values stay two nibbles")
    blocks = _q5_0(100, 576, 9)
    w = _five_bit(blocks)
    x = torch.randn(3, 576)
    got = int4_linear(x, w)
    scales, xin = (w.scale_min, x) if exact_mode() else (w.scales_zeros_bf16, x.bfloat16().float())
    out = torch.empty(3, 100)
    assert ops.int4_small_linear(xin, w, scales, 32, pack_layout()[1], None, out, w.hi_bits)
    assert torch.equal(got, out)
    ref = F.linear(x.double(), blocks.dequantize().double())
    assert ((got.double() - ref).norm() / ref.norm()).item() < 0.01
