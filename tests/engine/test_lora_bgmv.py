"""The C++ per-row LoRA op (engine/kernels/cpu/lora_bgmv.cpp) against the same deltas in float64:
rows with their own slots (in any order, some rows of the base model left alone), fused pieces
of different ranks (one absent), input and output widths off the 16-lane grid, float32 and
bfloat16; and what it declines."""

import pytest
import torch


def vector(ops) -> bool:  # runs wherever the build has AVX-512 or AVX2; generic builds decline
    return ops.isa() != "generic"


def reference(x, rows, slots, A, bts, firsts, widths, R, y):
    """y + each listed row's delta, in float64."""
    out = y.double().clone()
    for i, s in zip(rows.tolist(), slots.tolist()):
        for p, (bt, first, w) in enumerate(zip(bts, firsts, widths)):
            if w:
                t = A[s, p * R : p * R + w].double() @ x[i].double()
                out[i, first : first + bt.shape[2]] += t @ bt[s, :w].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "k,outs,widths",
    [(576, [576, 192, 192], [16, 8, 0]), (100, [37], [5]), (1536, [1536, 1536], [16, 16]), (33, [20, 7], [3, 16])],
)
@pytest.mark.parametrize("n_rows", [1, 5, 16])
def test_matches_float64(ops, dtype, k, outs, widths, n_rows):
    g = torch.Generator().manual_seed(k * 31 + n_rows)
    S, R, m = 6, 16, 20
    A = torch.randn(S, len(outs) * R, k, generator=g).to(dtype)
    bts = [torch.randn(S, R, o, generator=g).to(dtype) for o in outs]
    firsts = [sum(outs[:p]) for p in range(len(outs))]
    x = torch.randn(m, k + 3, generator=g).to(dtype)[:, 2 : 2 + k]  # rows strided past their width
    y = torch.randn(m, sum(outs), generator=g).to(dtype)
    rows = torch.randperm(m, generator=g)[:n_rows]
    slots = torch.randint(0, S, (n_rows,), generator=g)
    last = max(p * R + w for p, w in enumerate(widths) if w)
    want = reference(x, rows, slots, A, bts, firsts, widths, R, y)
    got = y.clone()
    if not ops.lora_bgmv(x, rows, slots, A, last, bts, firsts, widths, R, got):
        assert not vector(ops)
        assert torch.equal(got, y)  # declined: nothing written
        return
    assert vector(ops)
    untouched = [i for i in range(m) if i not in rows.tolist()]
    assert torch.equal(got[untouched], y[untouched])
    # The float32 sums' error bound (k products into each t, then the rank's into each delta, and
    # the add into y): (k + R + 1) float32 roundings of the same sums over absolute values; a
    # bfloat16 y is rounded once more, to 8 bits, as it is written.
    bound = reference(x.abs(), rows, slots, A.abs(), [b.abs() for b in bts], firsts, widths, R, y.abs())
    tol = (k + R + 1) * 2**-24 * bound
    if dtype == torch.bfloat16:
        tol += 2**-8 * want.abs()
    assert ((got.double() - want).abs() <= tol).all()


def test_declines_what_it_does_not_handle(ops):
    S, R, k = 2, 4, 32
    A = torch.randn(S, R, k)
    bts = [torch.randn(S, R, 16)]
    rows, slots = torch.tensor([0]), torch.tensor([1])
    y = torch.zeros(1, 16)

    def call(**kw):
        a = dict(x=torch.randn(1, k), rows=rows, slots=slots, A=A, last=R, bts=bts, firsts=[0], widths=[R], R=R, y=y)
        a.update(kw)
        out = a["y"].clone()
        ok = ops.lora_bgmv(
            a["x"], a["rows"], a["slots"], a["A"], a["last"], a["bts"], a["firsts"], a["widths"], a["R"], out
        )
        return ok, out

    assert call()[0] == vector(ops)
    for bad in (
        dict(x=torch.randn(1, k, dtype=torch.float16)),  # a dtype it has no path for
        dict(slots=torch.tensor([S])),  # a slot past the stack
        dict(rows=torch.tensor([1])),  # a row past x
        dict(firsts=[4]),  # a piece past y's columns
        dict(x=torch.randn(k, 2).t()[:1]),  # columns not contiguous
    ):
        ok, out = call(**bad)
        assert not ok and torch.equal(out, y), bad
