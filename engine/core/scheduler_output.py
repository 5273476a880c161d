"""Per-step messages between the scheduler and the model runner(s).

Only deltas cross this boundary (ARCHITECTURE.md, rule 1): a request's full state is sent once, when it is
first scheduled (or resumed after preemption); after that only new block ids and counts.
The runner keeps its own per-request state keyed by request id and appends the tokens it
sampled itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.lora.request import LoRARequest
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resuming after a recompute preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_slot: int = -1  # its adapter's slot while it runs (engine/lora/slots.py); -1: the base model


@dataclass
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests the runner must forget (finished, aborted or preempted since the last step).
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: set[str] = field(default_factory=set)
    # Speculative decoding: draft tokens scheduled after a request's last token (counted in
    # num_scheduled_tokens), and block tables cut back after rejected drafts (request id ->
    # blocks it keeps, applied before this step's new block ids).
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    truncated_block_tables: dict[str, int] = field(default_factory=dict)
    # Token-granular prefix hits (engine/core/tail_hits.py): (src block, dst block, n) copies
    # KV slots [0, n) of src into dst, every layer, before this step's forward.
    kv_copies: list[tuple[int, int, int]] = field(default_factory=list)
    # The offload tier (engine/kv_offload/), before the tail copies: (block id, slot, hash)
    # blocks evicted this step, copied out first; then (slot, block id, hash) tier hits copied in.
    kv_saves: list[tuple[int, int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, int, int]] = field(default_factory=list)
    # Structured outputs: request id -> [1 + drafts, ceil(V/32)] int32 bitmasks of the tokens
    # its sampled positions may take (engine/structured/matcher.py).
    grammar_bitmasks: dict[str, torch.Tensor] = field(default_factory=dict)
    # Multi-LoRA, applied before the step: adapters the workers drop from host memory, then
    # slot -> the adapter copied into it (None: the slot is cleared).
    lora_evictions: list[str] = field(default_factory=list)
    lora_loads: dict[int, LoRARequest | None] = field(default_factory=dict)

    @property
    def has_lora_changes(self) -> bool:
        return bool(self.lora_evictions or self.lora_loads)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def needs_run(self) -> bool:
        """The runner has something to do (model work, state to forget, blocks to move)."""
        return bool(
            self.total_num_scheduled_tokens
            or self.finished_request_ids
            or self.preempted_request_ids
            or self.kv_saves
            or self.kv_loads
            or self.has_lora_changes
        )

    @property
    def only_forgets(self) -> bool:
        """Nothing for the runner but requests to forget: a later step can carry those."""
        return not (
            self.total_num_scheduled_tokens
            or self.kv_saves
            or self.kv_loads
            or self.has_lora_changes
            or self.truncated_block_tables
        )


@dataclass
class ModelRunnerOutput:
    """What rank 0 returns after one step. `sampled_token_ids[i]` is empty for a request
    whose scheduled tokens did not reach the end of its prompt (a partial prefill chunk); with
    draft tokens it holds the accepted drafts plus one token (the correction or the bonus)."""

    request_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    # Prompt logprobs computed this step, per request id, positions in order (chunk by chunk).
    prompt_logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)
    # Embedding requests whose prompt ended this step: request id -> pooled, normalised vector.
    embeddings: dict[str, list[float]] = field(default_factory=dict)
    # Indices into SchedulerOutput.kv_loads of the loads that failed on some rank (recomputed).
    kv_load_failed: list[int] = field(default_factory=list)
