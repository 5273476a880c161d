"""The scheduler's speculative-decoding side: which running requests get drafts this step and
how many (proposer + draft-length policy), and the acceptance bookkeeping behind that choice.
The scheduler keeps what is its own: token budget, KV blocks, and rolling back rejected drafts."""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_length import AcceptanceCounts, DraftLengthPolicy, StepCostModel
from engine.spec_decode.ngram_proposer import NgramProposer

if TYPE_CHECKING:
    from engine.config import SchedulerConfig
    from engine.core.scheduler_output import SchedulerOutput
    from engine.request import Request
    from engine.spec_decode.draft_model import DraftModelProposer


class Drafting:
    def __init__(
        self,
        spec: SpeculativeConfig,
        config: SchedulerConfig,
        step_cost: StepCostModel | None,
        draft_model: DraftModelProposer | None = None,
    ) -> None:
        self.spec, self.config = spec, config
        # A draft model (methods "draft" and "self") is run for the k the policy chose; n-gram
        # lookup is free, so it proposes first and the policy trims.
        self.draft_model = draft_model
        self.proposer = draft_model or NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        cost = step_cost or StepCostModel.tokens_proportional(config.max_num_seqs, spec.num_speculative_tokens)
        draft_cost = draft_model.step_cost if draft_model is not None else None
        if draft_model is not None and draft_cost is None and spec.adaptive:
            # Unmeasured: assume the draft costs as much as the target per step (it rarely pays).
            draft_cost = cost
        self.policy = DraftLengthPolicy(spec.num_speculative_tokens, cost, spec.adaptive, draft_cost)
        self._acceptance: dict[str, AcceptanceCounts] = {}  # per running request
        self._acceptance_all = AcceptanceCounts()  # engine-wide: the prior of new requests
        # Cumulative, as vLLM counts them: verifications with drafts, draft and accepted tokens.
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    def propose(self, running: list[Request], waiting: deque[Request]) -> dict[str, list[int]]:
        """Drafts for running requests at their last token, k per request from the policy."""
        b = len(running)
        if not b:
            return {}
        # Prompt tokens this step will likely also compute (running chunks, then the queue).
        room = self.config.max_num_batched_tokens - b
        prefill = sum(r.num_tokens - r.num_computed_tokens - 1 for r in running)
        for r in waiting:
            if prefill >= room or len(running) >= self.config.max_num_seqs:
                break
            prefill += r.num_tokens - r.num_computed_tokens
        prefill = min(prefill, room)
        if not self.policy.worth_trying(b, prefill):
            return {}
        if self.draft_model is not None:
            return self._propose_with_model(running, b, prefill)
        k_max, max_len = self.spec.num_speculative_tokens, self.config.max_model_len
        prior = self._acceptance_all.rate(0.5)
        cands, proposals, rates = [], [], []
        for r in running:
            if r.num_computed_tokens != r.num_tokens - 1:
                continue  # still prefilling
            # Drafts plus the bonus token stay within max_tokens and the context (so in KV).
            room = min(k_max, r.max_tokens - r.num_output_tokens - 1, max_len - r.num_tokens - 1)
            d = self.proposer.propose(r.request_id, r.all_token_ids, room) if room > 0 else []
            if d:
                cands.append(r.request_id)
                proposals.append(d)
                counts = self._acceptance.get(r.request_id)
                rates.append(counts.rate(prior) if counts else prior)
        if not cands:
            return {}
        ks = self.policy.choose(b, rates, [len(d) for d in proposals], prefill)
        return {rid: d[:k] for rid, d, k in zip(cands, proposals, ks) if k > 0}

    def _propose_with_model(self, running: list[Request], b: int, prefill: int) -> dict[str, list[int]]:
        """k first (the policy counts the draft model's time), then the draft model runs."""
        k_max, max_len = self.spec.num_speculative_tokens, self.config.max_model_len
        # Optimistic until measured: drafting must start for its acceptance to be learnt, and
        # a draft model pays only at high acceptance (the first verifications correct this).
        prior = self._acceptance_all.rate(0.9)
        cands, rooms, rates, catchup, amortized = [], [], [], [], []
        for r in running:
            room = min(k_max, r.max_tokens - r.num_output_tokens - 1, max_len - r.num_tokens - 1)
            if r.num_computed_tokens != r.num_tokens - 1 or room <= 0:
                continue
            cands.append(r)
            rooms.append(room)
            counts = self._acceptance.get(r.request_id)
            rates.append(counts.rate(prior) if counts else prior)
            pending = self.draft_model.pending_tokens(r.request_id, r.num_tokens)
            catchup.append(pending)
            # The draft's first pass over the prompt is paid once and serves every later step
            # of the request: spread over its remaining output (else it would never start).
            amortized.append(min(pending, 2 + pending / max(1, r.max_tokens - r.num_output_tokens)))
        if not cands:
            return {}
        ks = self.policy.choose(b, rates, rooms, prefill, amortized)
        picked = [(r.request_id, r.all_token_ids, k) for r, k in zip(cands, ks) if k > 0]
        if not picked:
            return {}
        t0 = time.perf_counter()
        drafts = self.draft_model.propose_batch(picked)
        kept = [(k, c) for k, c in zip(ks, catchup) if k > 0]
        # Correct the draft's cost only where its table was measured: a first pass over a
        # prompt is a linear extrapolation far past it, and skewed the correction (0.76x seen).
        if self.spec.adaptive and max(c for _, c in kept) <= k_max + 1:
            predicted = self.policy.predicted_draft_seconds([k for k, _ in kept], [c for _, c in kept])
            self.policy.observe_draft(predicted, time.perf_counter() - t0)
        return drafts

    def release(self, request_id: str) -> None:
        """The request was preempted: its draft KV goes back (recomputed if it resumes)."""
        if self.draft_model is not None:
            self.draft_model.forget(request_id)

    def observe_step_time(self, so: SchedulerOutput, seconds: float) -> None:
        """Feed a decode-only step's wall time to the draft-length policy's cost correction."""
        if not self.spec.adaptive or not so.num_scheduled_tokens:
            return
        b = len(so.num_scheduled_tokens)
        k = sum(len(d) for d in so.scheduled_spec_tokens.values())
        if so.total_num_scheduled_tokens == b + k:
            self.policy.observe(b, k / b, seconds)

    def record(self, request_id: str, num_drafts: int, accepted: int) -> None:
        """Count one verification of `num_drafts` drafts of which `accepted` were kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        counts = self._acceptance.setdefault(request_id, AcceptanceCounts())
        for c in (counts, self._acceptance_all):
            c.accepted += accepted
            c.rejected += accepted < num_drafts

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
        self._acceptance.pop(request_id, None)
