"""Adaptive draft length: per step and per request, the k (down to 0) that maximises expected
tokens per second of the whole step, from each request's acceptance rate and a cost model of
the verify step measured on this machine at start-up.

A request with per-token acceptance a and k drafts emits 1 + a + a^2 + ... + a^k tokens in
expectation, so its j-th draft token is worth a^j. The best way to spend K extra tokens is on
the K largest a_i^j (a prefix of drafts per request), and K itself maximises
(B + gain(K)) / cost(B, K / B). When the step is compute-bound, extra tokens cost as much as
they are worth, no K > 0 wins, and every k is 0.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

_MARGIN = 1.03  # speculate only for a predicted gain above measurement noise
_PRIOR_WEIGHT = 4.0
_EMA = 0.1  # weight of one step's timing in the online cost correction  # a new request's acceptance starts at the engine-wide rate, worth 4 drafts


class StepCostModel:
    """Seconds of one step of B rows, each computing 1 + k tokens (measured for a grid of B and
    k; linear between the measured B and k, linear extrapolation past the largest)."""

    def __init__(self, table: dict[tuple[int, int], float]) -> None:
        self.batch_sizes = sorted({b for b, _ in table})
        self.ks = sorted({k for _, k in table})
        # Timing noise must not make a longer step look cheaper: non-decreasing in k and in B.
        self.table = dict(table)
        for b in self.batch_sizes:
            for k0, k1 in zip(self.ks, self.ks[1:]):
                if (b, k0) in self.table and (b, k1) in self.table:
                    self.table[(b, k1)] = max(self.table[(b, k1)], self.table[(b, k0)])
        for k in self.ks:
            for b0, b1 in zip(self.batch_sizes, self.batch_sizes[1:]):
                if (b0, k) in self.table and (b1, k) in self.table:
                    self.table[(b1, k)] = max(self.table[(b1, k)], self.table[(b0, k)])
        self._measured_bs = set(self.batch_sizes)

    @classmethod
    def tokens_proportional(cls, max_batch: int, max_k: int) -> StepCostModel:
        """Without a measurement: a fixed cost of 32 tokens' worth plus one per token."""
        bs = [1 << i for i in range(max(1, max_batch).bit_length() + 1)]
        return cls({(b, k): 32.0 + b * (1 + k) for b in bs for k in range(max_k + 1)})

    def _at_b(self, b: int, k: float) -> float:
        ks = self.ks
        i = min(max(bisect.bisect_right(ks, k) - 1, 0), len(ks) - 2) if len(ks) > 1 else 0
        if len(ks) == 1:
            return self.table[(b, ks[0])]
        k0, k1 = ks[i], ks[i + 1]
        t0, t1 = self.table[(b, k0)], self.table[(b, k1)]
        return t0 + (t1 - t0) * (k - k0) / (k1 - k0)

    def cost(self, b: int, k: float) -> float:
        """One step of b rows with k draft tokens per row on average."""
        bs = self.batch_sizes
        if b in self._measured_bs:
            return self._at_b(b, k)
        i = min(max(bisect.bisect_right(bs, b) - 1, 0), len(bs) - 2) if len(bs) > 1 else 0
        if len(bs) == 1:
            return self._at_b(bs[0], k) * b / bs[0]
        b0, b1 = bs[i], bs[i + 1]
        t0, t1 = self._at_b(b0, k), self._at_b(b1, k)
        return max(t0 + (t1 - t0) * (b - b0) / (b1 - b0), 1e-9)


@dataclass
class AcceptanceCounts:
    accepted: int = 0  # draft tokens accepted
    rejected: int = 0  # verifications that ended at a rejected draft

    def rate(self, prior: float) -> float:
        """Per-token acceptance, the geometric MLE shrunk towards `prior`."""
        return (self.accepted + _PRIOR_WEIGHT * prior) / (self.accepted + self.rejected + _PRIOR_WEIGHT)


class DraftCost:
    """Seconds a draft model takes to propose: its first step computes each row's unseen tokens
    (`catchup`), every later step one token for the rows that still want more drafts. Kept
    incrementally as rows get one more draft each, as the policy's search adds them."""

    def __init__(self, cost: StepCostModel, catchup: list[float]) -> None:
        self.cost, self.catchup = cost, catchup
        self.ks = [0] * len(catchup)
        self.rows: list[int] = [0]  # rows[j]: rows with more than j drafts
        self.first_tokens = 0.0
        self.seconds = 0.0

    def _step(self, j: int) -> float:
        if not self.rows[j]:
            return 0.0
        if j == 0:
            return self.cost.cost(self.rows[0], self.first_tokens / self.rows[0] - 1)
        return self.cost.cost(self.rows[j], 0)

    def add(self, i: int) -> float:
        """Row i gets one more draft; returns the new total."""
        j = self.ks[i]
        self.ks[i] += 1
        if j == len(self.rows):
            self.rows.append(0)
        self.seconds -= self._step(j)
        self.rows[j] += 1
        if j == 0:
            self.first_tokens += self.catchup[i]
        self.seconds += self._step(j)
        return self.seconds


class DraftLengthPolicy:
    def __init__(
        self, k_max: int, cost: StepCostModel, adaptive: bool = True, draft_cost: StepCostModel | None = None
    ) -> None:
        self.k_max, self.cost, self.adaptive = k_max, cost, adaptive
        self.draft_cost = draft_cost  # a draft model's proposing time (None: proposals are ~free)
        # Online correction of the start-up tables by real decode-only steps (contexts, kernels
        # and load differ from the measurement): observed / predicted, with and without drafts,
        # and of the draft model's proposing time.
        self._ratio_plain = self._ratio_spec = self._ratio_draft = 1.0

    def _draft_seconds(self, b: int, k: int) -> float:
        """b rows, k drafts each, two unseen tokens per row (the usual accepted + bonus)."""
        if self.draft_cost is None:
            return 0.0
        return self._ratio_draft * (self.draft_cost.cost(b, 1) + (k - 1) * self.draft_cost.cost(b, 0))

    def predicted_draft_seconds(self, ks: list[int], catchup: list[float]) -> float:
        if self.draft_cost is None:
            return 0.0
        dc = DraftCost(self.draft_cost, catchup)
        for i, k in enumerate(ks):
            for _ in range(k):
                dc.add(i)
        return dc.seconds

    def observe_draft(self, predicted: float, seconds: float) -> None:
        """A draft model's proposing took `seconds` where the uncorrected table said `predicted`."""
        if predicted > 0:
            r = min(max(seconds / predicted, 0.25), 4.0)
            self._ratio_draft += _EMA * (r - self._ratio_draft)

    def _cost(self, b: int, k: float) -> float:
        return self.cost.cost(b, k) * (self._ratio_spec if k > 0 else self._ratio_plain)

    def observe(self, b: int, k: float, seconds: float) -> None:
        """A step of b rows with k drafts per row on average (no prefill) took `seconds`."""
        r = min(max(seconds / self.cost.cost(b, k), 0.25), 4.0)
        if k > 0:
            self._ratio_spec += _EMA * (r - self._ratio_spec)
        else:
            self._ratio_plain += _EMA * (r - self._ratio_plain)

    def worth_trying(self, b: int, prefill: int = 0) -> bool:
        """Could drafts pay at b rows even if every one were accepted? (Skips proposing.)"""
        if not self.adaptive:
            return True
        # Prompt tokens are work the step does too: drafts that slow them down must pay for it.
        base = (b + prefill) / self._cost(b, prefill / b)
        return any(
            (b + prefill + b * k) / (self._cost(b, k + prefill / b) + self._draft_seconds(b, k)) > _MARGIN * base
            for k in range(1, self.k_max + 1)
        )

    def choose(
        self, b: int, rates: list[float], available: list[int], prefill: int = 0, catchup: list[float] | None = None
    ) -> list[int]:
        """k per candidate row (b rows in the step, `prefill` more prompt tokens expected in it;
        `available[i]` drafts proposed, or allowed, for row i; `catchup[i]` the tokens a draft
        model would first have to compute for row i)."""
        if not self.adaptive:
            return [min(self.k_max, a) for a in available]
        gains = sorted(
            ((rate**j, i) for i, (rate, a) in enumerate(zip(rates, available)) for j in range(1, a + 1)),
            reverse=True,
        )
        base = (b + prefill) / self._cost(b, prefill / b)
        best, best_k, total = _MARGIN * base, 0, float(b + prefill)
        draft = None if self.draft_cost is None else DraftCost(self.draft_cost, catchup or [2] * len(rates))
        for n, (g, i) in enumerate(gains, start=1):
            total += g
            seconds = self._cost(b, (prefill + n) / b)
            if draft is not None:
                seconds += self._ratio_draft * draft.add(i)
            thr = total / seconds
            if thr > best:
                best, best_k = thr, n
        ks = [0] * len(rates)
        for _, i in gains[:best_k]:
            ks[i] += 1
        return ks
