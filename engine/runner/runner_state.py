"""The model runner's own per-request state, kept across steps so only deltas travel."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.scheduler_output import SchedulerOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class RunnerRequestState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)  # this step's drafts, after the last token
    pooled_sum: torch.Tensor | None = None  # mean pooling: the float32 sum of the hidden rows so far (pooling.py)
    lora_slot: int = -1  # its adapter's slot (engine/lora/); -1: the base model

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        n = self.num_tokens
        if end > n:  # draft tokens follow the sequence's own
            return self.token_slice(min(start, n), n) + self.spec_token_ids[max(0, start - n) : end - n]
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]


class RunnerStates(dict):
    """request id -> RunnerRequestState, updated from each SchedulerOutput."""

    def apply(self, so: SchedulerOutput) -> None:
        for rid in so.finished_request_ids | so.preempted_request_ids:
            self.pop(rid, None)
        for rid, keep in so.truncated_block_tables.items():
            st = self.get(rid)
            if st is not None:
                del st.block_ids[keep:]
        for new in so.new_requests:
            self[new.request_id] = RunnerRequestState(
                new.request_id,
                list(new.prompt_token_ids),
                list(new.output_token_ids),
                new.sampling_params,
                list(new.block_ids),
                new.num_computed_tokens,
                lora_slot=new.lora_slot,
            )
        for cached in so.cached_requests:
            st = self.get(cached.request_id)
            if st is None:
                raise RuntimeError(f"runner has no state for request {cached.request_id}")
            st.block_ids.extend(cached.new_block_ids)
            st.num_computed_tokens = cached.num_computed_tokens
        for rid, drafts in so.scheduled_spec_tokens.items():  # the runner clears them after the step
            self[rid].spec_token_ids = drafts
