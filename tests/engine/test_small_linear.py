"""The few-row C++ linear (small_linear.cpp, and small_linear_rows16.cpp over bf16 panels of 16
rows on AVX2) against F.linear, and its use by packed_gemm.linear."""

import pytest
import torch
import torch.nn.functional as F

from engine.layers.packed_gemm import (
    OP_ROWS,
    PANEL_ORDER,
    SMALL_ROWS,
    bf16_gemm_native,
    linear,
    pack_rows16,
    pack_weight,
    packing_enabled,
    rows16_enabled,
    small_rows,
)
from tests.engine.gil import Spinner


def vector(ops) -> bool:  # runs wherever the build has AVX-512 or AVX2; generic builds decline
    return ops.isa() != "generic"


@pytest.mark.parametrize(
    "xdt,wdt", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)]
)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 19, 64])
@pytest.mark.parametrize("n,k", [(1, 16), (15, 80), (17, 576), (100, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_small_linear_matches_f_linear(ops, xdt, wdt, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).to(xdt)
    w = torch.randn(n, k, generator=g).to(wdt)
    b = torch.randn(n, generator=g).to(xdt) if bias else None
    out = torch.full((m, n), float("nan"), dtype=xdt)
    if not ops.small_linear(x, w, b, out):
        assert not vector(ops)
        assert out.isnan().all()  # declined: nothing written
        return
    assert vector(ops)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    tol = 1e-4 * k**0.5 if xdt == torch.float32 else 2e-2 * max(1.0, ref.abs().max().item())
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=1e-2 if xdt == torch.bfloat16 else 1e-5)


def test_the_op_lets_other_python_threads_run_while_it_computes(ops):
    """In a serving replica the asyncio loop hands tokens over while a step runs: the op drops
    the GIL (bindings.cpp). 64 rows x 4096 x 4096 in float32 take tens of ms per call here."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 4096, generator=g), torch.randn(4096, 4096, generator=g)
    out = torch.empty(64, 4096)
    with Spinner() as spin:
        took = [spin.timed(lambda: ops.small_linear(x, w, None, out)) for _ in range(4)]
    if not all(took):
        assert not vector(ops)  # generic build: it declines at once
        return
    assert spin.stamps_inside() > 0, spin.calls


def test_small_linear_declines_what_it_does_not_cover(ops):
    w = torch.randn(32, 64)
    for x, ww, out in [
        (torch.randn(65, 64), w, torch.empty(65, 32)),  # too many rows for one call
        (torch.randn(1, 20), torch.randn(32, 20), torch.empty(1, 32)),  # k % 16
        (torch.randn(1, 64), w.t().contiguous().t(), torch.empty(1, 32)),  # strided weight
        (torch.randn(1, 64).double(), w.double(), torch.empty(1, 32).double()),
    ]:
        assert not ops.small_linear(x, ww, None, out)
    assert not ops.small_linear(torch.randn(1, 64), w, torch.randn(32).bfloat16(), torch.empty(1, 32))


@pytest.mark.skipif(not packing_enabled(torch.float32, torch.device("cpu")), reason="oneDNN is not in this torch build")
def test_packed_linear_takes_the_small_path_at_few_rows(ops, monkeypatch):
    w, b = torch.randn(96, 64), torch.randn(96)
    packed = pack_weight(w)
    assert (packed.plain is not None) == vector(ops)
    for m in (1, SMALL_ROWS, SMALL_ROWS + 1, 40):
        x = torch.randn(m, 64)
        got = linear(x, packed, b)
        torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
        if vector(ops) and m <= SMALL_ROWS:  # bit-equal to the op: it ran, not oneDNN
            direct = torch.empty(m, 96)
            assert ops.small_linear(x, w, b, direct) and torch.equal(got, direct)
    monkeypatch.setenv("ORBITAL_SMALL_LINEAR", "0")
    assert pack_weight(w).plain is None


@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(ops, wdt):
    """Rows share passes over the weight (4 at a time, the rest in smaller tiles), but each row's
    sums run in one order: bit-equal whatever the call's row count, so batching and preemption's
    recompute keep a sequence's greedy tokens."""
    if not vector(ops):
        pytest.skip("the generic build has no few-row op")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(OP_ROWS, 576, generator=g).to(wdt)
    w = torch.randn(77, 576, generator=g).to(wdt)
    alone = torch.empty(OP_ROWS, 77, dtype=wdt)
    for i in range(OP_ROWS):
        assert ops.small_linear(x[i : i + 1], w, None, alone[i : i + 1])
    for m in (2, 3, 4, 5, 7, 9, 33, OP_ROWS):
        y = torch.empty(m, 77, dtype=wdt)
        assert ops.small_linear(x[:m], w, None, y)
        assert torch.equal(y, alone[:m]), m


def test_plain_bf16_weights_take_the_op_at_every_row_count_where_bf16_gemm_is_emulated(ops):
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(40, 96, generator=g).bfloat16(), torch.randn(40, generator=g).bfloat16()
    x = torch.randn(OP_ROWS + 30, 96, generator=g).bfloat16()
    got = linear(x, w, b)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), b.float()), atol=0.1, rtol=2e-2)
    if not vector(ops):
        return  # no op in this build: F.linear ran (checked above)
    if bf16_gemm_native():
        assert small_rows(w) == SMALL_ROWS  # oneDNN's native bf16 GEMM past 4 rows
        return
    assert small_rows(w) is None
    rows = torch.empty_like(got)  # one row per call: bit-equal, so the op ran for every row
    for i in range(x.shape[0]):
        assert ops.small_linear(x[i : i + 1], w, b, rows[i : i + 1])
    assert torch.equal(got, rows)
    assert small_rows(w.float()) == SMALL_ROWS  # float32 weights: oneDNN past 4 rows


def test_rows16_panels_hold_the_weight_in_panel_order():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(37, 32, generator=g).bfloat16()
    p = pack_rows16(w)
    assert p.shape == (3, 32, 16) and p.out_features == 37
    for b in range(3):
        for t, o in enumerate(PANEL_ORDER):
            row = b * 16 + o
            assert torch.equal(p[b, :, t], w[row] if row < 37 else torch.zeros(32, dtype=torch.bfloat16))


@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(1, 16), (37, 80), (100, 1536)])
def test_rows16_panels_compute_f_linear_and_a_rows_result_alone(ops, xdt, n, k):
    """The outer-product path (AVX2 builds) where it runs, else the op declines (checked): the
    result is F.linear's, and each row's bits are the same whatever rows share its call."""
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).to(xdt)
    x = torch.randn(OP_ROWS + 9, k, generator=g).to(xdt)
    p = pack_rows16(w)
    y = torch.empty(OP_ROWS, n, dtype=xdt)
    if not ops.small_linear(x[:OP_ROWS], p, b, y):
        assert ops.isa() != "avx2"  # the path is built for the avx2 target only
        return
    ref = F.linear(x.double(), w.double(), b.double())
    got = linear(x, p, b)
    tol = dict(atol=1e-4, rtol=1e-4) if xdt == torch.float32 else dict(atol=0.1, rtol=2e-2)
    torch.testing.assert_close(got.double(), ref, **tol)
    for m in (1, 2, 3, 5, 8, 13):
        for i in (0, 3):
            assert torch.equal(linear(x[i : i + m], p, b), got[i : i + m]), (m, i)


def test_bf16_models_load_their_linears_as_panels_where_the_avx2_path_runs(ops):
    """Where rows16_enabled (the op built for AVX2, bf16 GEMMs emulated) pack_weight gives panels;
    elsewhere oneDNN's layout or nothing (packing off), as before."""
    w = torch.randn(48, 64).bfloat16()
    if not rows16_enabled():
        assert ops.isa() != "avx2" or bf16_gemm_native()
        return
    assert packing_enabled(torch.bfloat16, torch.device("cpu"))
    p = pack_weight(w)
    assert p.dim() == 3 and p.out_features == 48 and small_rows(p) is None
    x = torch.randn(3, 64).bfloat16()
    torch.testing.assert_close(linear(x, p).float(), F.linear(x.float(), w.float()), atol=0.05, rtol=2e-2)
    assert linear(torch.empty(0, 64, dtype=torch.bfloat16), p).shape == (0, 48)
