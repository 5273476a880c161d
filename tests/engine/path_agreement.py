"""How closely two computation paths of one model must agree (batching, chunking, preemption's
recompute, the P/D hand-off, tensor-parallel shards), and the check that holds them to it.

ARCHITECTURE.md rule 14: the paths compute from the same numbers and differ only in the order of
float32 sums (GEMM blocking picked by row count, an all-reduce over shards, AMX tiles against
AVX-512 FMAs). In float32 end to end that moves a logprob by a few ulps of the logits:
FLOAT32_NOISE covers it on every CPU kind.

A path that rounds an intermediate to a coarse format (an int8 or fp8 KV row, bf16 activations)
amplifies that noise: a value within a float32 reordering of a rounding boundary lands on either
side, and then differs between the paths by one step of the format. That is no longer noise of
float32 size: the next layer reads the changed value, its own inputs to the quantizer move by
more than a reordering, more values cross boundaries, and layer by layer the two paths' rounding
errors become independent draws of the same rounding. Each path's result stays within the
rounding's own effect of the exact one (every value moves by at most half a step either way),
so the two differ by at most twice that effect: `rounding_bound` measures the effect on the
test's own prompts (the same engine one format finer, or coarser, against the coarse one) and
doubles it. Measured on an AVX-512 Xeon, the int8 KV cache's effect on these logprobs is
~0.2 and two paths' difference up to ~0.1 (a float32 cache: 1e-5); so the bound follows
from the format and the model, not from the CPU that ran it (AMX tiles and AVX FMAs only change
which values cross).

Greedy tokens follow: where the reference's best two candidates are closer than twice the bound,
either path may take either one, and from there on the two sequences continue different texts,
both right. `assert_paths_agree` compares every position up to such a near-tie and none after.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

FLOAT32_NOISE = 1e-4  # logprob difference of two float32 paths (sum order only), every CPU kind


def _shared_positions(a, b):
    """(a's, b's) TokenLogprob pairs up to the first position whose sampled tokens differ."""
    for la, lb in zip(a.logprobs or [], b.logprobs or []):
        if la.token_id != lb.token_id:
            return
        yield la, lb


def rounding_effect(coarse: Sequence, fine: Sequence) -> float:
    """The largest logprob change a coarse format makes: max |coarse - fine| over every position
    where the two greedy outputs still agree, of the sampled token and of every top candidate
    both list (what `assert_paths_agree` compares; RequestOutputs with logprobs, same order)."""
    worst = 0.0
    for rc, rf in zip(coarse, fine, strict=True):
        for cc, cf in zip(rc.outputs, rf.outputs, strict=True):
            assert cc.logprobs and cf.logprobs, "rounding_effect needs outputs with logprobs"
            for la, lb in _shared_positions(cc, cf):
                theirs = dict(lb.top) | {lb.token_id: lb.logprob}
                mine = dict(la.top) | {la.token_id: la.logprob}
                worst = max([worst] + [abs(v - theirs[t]) for t, v in mine.items() if t in theirs])
    return worst


def rounding_bound(coarse: Sequence, fine: Sequence) -> float:
    """How far two paths that both round to the coarse format may differ (module docstring)."""
    return max(FLOAT32_NOISE, 2 * rounding_effect(coarse, fine))


def _near_tie(lp, bound: float) -> bool:
    """The reference's best two candidates here are within reach of the other path's noise."""
    top = [v for _, v in lp.top]
    return len(top) >= 2 and top[0] - top[1] <= 2 * bound


def _ordered_prefix(lp, bound: float) -> list[int]:
    """The ids of `lp.top` whose order no noise within `bound` can change: each one's gap to the
    next is over twice the bound (the last shown has an unseen next, so it is left out)."""
    ids = []
    for (tok, v), (_, nxt) in zip(lp.top, lp.top[1:]):
        if v - nxt <= 2 * bound:
            break
        ids.append(tok)
    return ids


def assert_paths_agree(got: Sequence, expected: Sequence, bound: float = FLOAT32_NOISE) -> None:
    """`got` and `expected` (RequestOutputs of greedy requests, in the same order) as two paths
    of one computation: the same tokens, text and finish, logprobs within `bound`, up to the
    first near-tie of `expected` (seen where it has logprobs >= 2; outputs without them must be
    equal whole)."""
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.error is None and b.error is None, (a.error, b.error)
        assert len(a.outputs) == len(b.outputs)
        for ca, cb in zip(a.outputs, b.outputs):
            tied_at = next((i for i, lb in enumerate(cb.logprobs or []) if _near_tie(lb, bound)), None)
            if tied_at is None:
                assert ca.token_ids == cb.token_ids and ca.text == cb.text
                assert ca.finish_reason == cb.finish_reason and ca.stop_reason == cb.stop_reason
            else:
                assert ca.token_ids[:tied_at] == cb.token_ids[:tied_at], f"differ before the near-tie at {tied_at}"
            for i, (la, lb) in enumerate(zip(ca.logprobs or [], cb.logprobs or [])):
                if tied_at is not None and i > tied_at:
                    break
                if tied_at is None or i < tied_at:
                    assert la.token_id == lb.token_id
                if la.token_id == lb.token_id:
                    assert la.logprob == pytest.approx(lb.logprob, abs=bound), (i, la.token_id)
                if i == tied_at:
                    continue
                want = _ordered_prefix(lb, bound)
                assert [t for t, _ in la.top][: len(want)] == want, i
                theirs = dict(lb.top)
                for tok, v in la.top:  # every candidate both list: within the bound
                    if tok in theirs:
                        assert v == pytest.approx(theirs[tok], abs=bound), (i, tok)
