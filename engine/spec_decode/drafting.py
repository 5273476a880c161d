"""The scheduler's speculative-decoding side: which running requests get drafts this step and
how many (proposer + draft-length policy), and the acceptance bookkeeping behind that choice.
The scheduler keeps what is its own: token budget, KV blocks, and rolling back rejected drafts."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_length import AcceptanceCounts, DraftLengthPolicy, StepCostModel
from engine.spec_decode.ngram_proposer import NgramProposer

if TYPE_CHECKING:
    from engine.config import SchedulerConfig
    from engine.core.scheduler_output import SchedulerOutput
    from engine.request import Request


class Drafting:
    def __init__(self, spec: SpeculativeConfig, config: SchedulerConfig, step_cost: StepCostModel | None) -> None:
        self.spec, self.config = spec, config
        self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        cost = step_cost or StepCostModel.tokens_proportional(config.max_num_seqs, spec.num_speculative_tokens)
        self.policy = DraftLengthPolicy(spec.num_speculative_tokens, cost, spec.adaptive)
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
