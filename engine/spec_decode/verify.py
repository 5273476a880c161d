"""Verification of draft tokens against the target model's own samples.

The runner samples the target's token t_j at every scored position j (after the last token and
after each draft) exactly as it would without speculation: same processing (penalties and
min_tokens see the drafts before j as output), same generator keyed by the output position.
Draft d_j is accepted when t_j == d_j; the first mismatch emits t_j and ends the run; when all
k drafts pass, t_k is the bonus token.

For an n-gram draft (a point mass q = delta(d)) this is rejection sampling: d is accepted with
probability p(d) = min(1, p(d) / q(d)), and on rejection t is distributed as p with d removed,
renormalised, which is the residual max(p - q, 0) normalised. Greedy rows accept d exactly when
it is the argmax. Because t_j is the very token the non-speculative engine would have drawn at
that position, output (greedy or seeded) is identical with speculation on and off, whatever the
batch and whatever k the policy picked.
"""

from __future__ import annotations

from engine.outputs import TokenLogprob


def accept_drafts(
    drafts: list[int], target_tokens: list[int], logprobs: list[list[TokenLogprob] | None], row: int
) -> tuple[list[int], list[TokenLogprob] | None]:
    """Tokens emitted for one request whose 1 + len(drafts) scored positions start at `row`:
    the accepted drafts plus the correction or bonus token, with one logprob entry each."""
    emitted: list[int] = []
    lps: list[TokenLogprob] | None = None if logprobs[row] is None else []
    for j in range(len(drafts) + 1):
        t = target_tokens[row + j]
        emitted.append(t)
        if lps is not None:
            lps.extend(logprobs[row + j])
        if j == len(drafts) or t != drafts[j]:
            break
    return emitted, lps
