"""The few-row C++ linear (small_linear.cpp) against F.linear, and its use by packed_gemm.linear."""

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu_ops import load_cpu_ops
from engine.layers.packed_gemm import SMALL_ROWS, linear, pack_weight, packing_enabled


@pytest.fixture(scope="module")
def ops():
    mod = load_cpu_ops()
    assert mod is not None, "the C++ CPU ops did not build"
    return mod


def vector(ops) -> bool:  # runs wherever the build has AVX-512 or AVX2; generic builds decline
    return ops.isa() != "generic"


@pytest.mark.parametrize(
    "xdt,wdt", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)]
)
@pytest.mark.parametrize("m", [1, 2, 5, 8])
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


def test_small_linear_declines_what_it_does_not_cover(ops):
    w = torch.randn(32, 64)
    for x, ww, out in [
        (torch.randn(9, 64), w, torch.empty(9, 32)),  # too many rows
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
