"""int8 activations in the few-row int4 op (int4_int8_dot.h, `int8_x`): each row rounded per group
to int8 (d = max|x| / 127, q = round-half-even(x * (127 / max|x|))), integer dot products with the weight's
values, then the exact scales and mins. Against the same rounding done here in float32 and the
dequantized weight in float64: the integer sums are exact, so the tolerance is
test_int4_small_linear.py's for float32 sums in another order (bf16 outputs round once more).
Against the unrounded activations: within the rounding's own bound, sum_g d_g / 2 * sum |w|."""

from __future__ import annotations

import pytest
import torch

from engine.layers.quant.blocks import BlockQuantized
from engine.layers.quant.int4_format import dequantize_int4, pack_int4, pack_layout, quantize_int4
from tests.engine.test_int4_small_linear import assert_matches, pack_rows, pytorch_weight, q8_0_two_nibbles
from tests.engine.test_small_linear import vector


def int8_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x rounded as the op rounds it (float32, per row and group), back in float32: d * q; and
    per value the slack d where x * 127 / max|x| lies within 4 float32 steps of a tie (a bf16 x
    of half the group's max is one: 63.5), which the op's float32 arithmetic may round either way."""
    xf = x.float()
    m, k = xf.shape
    g = xf.view(m, k // group, group)
    amax = g.abs().amax(-1, keepdim=True)
    p = g * torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(p).clamp(-127, 127)
    d = amax / 127.0
    near_tie = ((p.abs() - p.abs().floor() - 0.5).abs() <= 4 * 2.0**-24 * p.abs()).float()
    return (q * d).view(m, k), (near_tie * d).view(m, k)


def assert_matches_rounded(out, x, group, w_float, bias=None):
    """test_int4_small_linear.py's bound for float32 sums over the rounded rows, plus one step of
    d * |w| wherever the rounding may go either way."""
    xr, slack = int8_rows(x, group)
    assert_matches(out, xr, w_float, bias, extra=slack.double() @ w_float.double().abs().t())


def run_int8(ops, x, w, scale_min=None, bias=None, block_rows=None):
    out = torch.full((x.shape[0], w.out_features), float("nan"), dtype=x.dtype)
    sm = w.scale_min if scale_min is None else scale_min
    hb = getattr(w, "hi_bits", None)
    ok = ops.int4_small_linear(x, w, sm, w.group_size, block_rows or pack_layout()[1], bias, out, hb, int8_x=True)
    if not ok:
        assert out.isnan().all()
        return None
    return out


def runs(ops) -> bool:
    return vector(ops) and ops.int8_dot_products() and pack_layout()[1] == 64


def _q5_0(n: int, k: int, seed: int) -> BlockQuantized:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-16, 16, (n, k), generator=g, dtype=torch.int8)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    return BlockQuantized(q, d, torch.zeros_like(d), bits=8, kind="Q5_0")


@pytest.mark.parametrize("m", [1, 3, 4, 13, 64])
@pytest.mark.parametrize("n,k,group", [(100, 64, 32), (960, 576, 64), (100, 1536, 128)])
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", ["exact", "pairs"])
def test_four_bits_match_the_rounded_rows(ops, m, n, k, group, xdt, scales):
    g = torch.Generator().manual_seed(m * 7 + k + group)
    w = quantize_int4(torch.randn(n, k, generator=g) * torch.linspace(0.1, 2.0, n)[:, None], group)
    x = (torch.randn(m, k, generator=g) * torch.linspace(0.01, 3.0, k)).to(xdt)
    x[0, :group] = 0  # an all-zero group: d = 0
    sm = w.scales_zeros_bf16 if scales == "pairs" else w.scale_min
    out = run_int8(ops, x, w, scale_min=sm)
    if not runs(ops):
        assert out is None
        return
    w_float = pytorch_weight(w) if scales == "pairs" else dequantize_int4(w)
    assert_matches_rounded(out, x, group, w_float)


@pytest.mark.parametrize("m", [1, 4, 7, 33])
@pytest.mark.parametrize("scales", ["exact", "pairs"])
def test_five_bits_and_a_bias(ops, m, scales):
    blocks = _q5_0(200, 576, m)
    nibbles, hi_bits, scale, minimum = blocks.as_five_bits()
    w = pack_int4(nibbles, scale, minimum, blocks.group, hi_bits=hi_bits)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 576, generator=g).to(torch.bfloat16)
    bias = torch.randn(200, generator=g).to(torch.bfloat16)
    sm = w.scales_zeros_bf16 if scales == "pairs" else w.scale_min
    out = run_int8(ops, x, w, scale_min=sm, bias=bias)
    if not runs(ops):
        assert out is None
        return
    assert_matches_rounded(out, x, 32, pytorch_weight(w) if scales == "pairs" else blocks.dequantize(), bias)


@pytest.mark.parametrize("m", [1, 5])
def test_two_nibbles_read_the_rounded_rows_twice(ops, m):
    """A Q8_0 weight as two nibbles (inputs 2k, x twice over): both halves round alike."""
    g = torch.Generator().manual_seed(m)
    n, k = 160, 576
    blocks, w = q8_0_two_nibbles(n, k, g)
    x = torch.randn(m, k, generator=g)
    out = run_int8(ops, x, w)
    if not runs(ops):
        assert out is None
        return
    assert_matches_rounded(out, x, 32, blocks.dequantize())


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(ops):
    w = quantize_int4(torch.randn(300, 576), 32)
    x = torch.randn(50, 576).to(torch.bfloat16)
    together = run_int8(ops, x, w, scale_min=w.scales_zeros_bf16)
    if not runs(ops):
        return
    alone = torch.cat([run_int8(ops, x[i : i + 1], w, scale_min=w.scales_zeros_bf16) for i in range(50)])
    assert torch.equal(together, alone)


def test_within_the_roundings_bound_of_the_unrounded_rows(ops):
    """|x . w - xq . w| <= sum over groups of d_g / 2 * sum |w| (each x moves at most d / 2)."""
    group = 32
    w = quantize_int4(torch.randn(256, 576), group)
    x = torch.randn(8, 576)
    out = run_int8(ops, x, w)
    if not runs(ops):
        return
    wf = dequantize_int4(w).double()
    exact = x.double() @ wf.t()
    d = x.view(8, -1, group).abs().amax(-1).double() / 127  # [m, groups]
    wsum = wf.abs().view(256, -1, group).sum(-1)  # [n, groups]
    bound = (d / 2) @ wsum.t() + 1e-5 * (x.double().abs() @ wf.abs().t())
    err = (out.double() - exact).abs()
    assert (err <= bound).all()
    assert err.max() > 0  # the rows were rounded


def test_declines_what_it_does_not_cover(ops):
    w = quantize_int4(torch.randn(64, 64), 32)
    x = torch.randn(1, 64)
    q = torch.randint(0, 16, (64, 64), dtype=torch.uint8)
    out = torch.empty(1, 64)
    # the 32-row (AVX2) layout: no integer path for it
    w32 = torch.nn.Parameter(pack_rows(q, 32), requires_grad=False)
    assert not ops.int4_small_linear(x, w32, w.scale_min, 32, 32, None, out, None, int8_x=True)
    if not runs(ops):  # nowhere without VNNI, VBMI and BITALG
        assert run_int8(ops, x, w) is None


def test_the_setting_needs_quantized_weights_and_the_cpu_for_it():
    from engine import LLM
    from engine.errors import InvalidRequestError
    from engine.layers.quant.int4 import int8_dot_runs

    with pytest.raises(InvalidRequestError, match="set quantization"):
        LLM(int8_activations=True, num_threads=1)
    if not int8_dot_runs():
        with pytest.raises(InvalidRequestError, match="VNNI"):
            LLM(int8_activations=True, quantization="int4", num_threads=1)


@pytest.mark.parametrize("two_nibbles", [False, True])
def test_a_marked_weight_takes_the_op_at_every_row_count(ops, two_nibbles):
    """int4_linear runs a weight marked by mark_int8_activations through the op in 64-row chunks
    at 300 rows too (no widened GEMM past CHUNKED_ROWS, no float32 GEMM for 8-bit values), bit
    for bit what the op gives each chunk alone."""
    from engine.layers.quant.int4 import exact_mode, int4_linear, op_scales

    g = torch.Generator().manual_seed(3)
    if two_nibbles:
        w = q8_0_two_nibbles(96, 576, g)[1]
    else:
        w = quantize_int4(torch.randn(96, 576, generator=g), 32)
    x = torch.randn(300, 576, generator=g)
    if not runs(ops):
        return
    w.int8_activations = True
    xin = x if exact_mode() else x.bfloat16().float()  # what int4_linear hands the op
    want = torch.cat([run_int8(ops, xin[c : c + 64], w, scale_min=op_scales(w)) for c in range(0, 300, 64)])
    assert torch.equal(int4_linear(x, w), want)
