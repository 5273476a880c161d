"""What the engine hands back: token-level core outputs and user-facing request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Logprob of one chosen token plus the top-k alternatives at that position."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    # Filled by the output processor (text side): decoded strings of token_id and of `top`.
    decoded: str | None = None
    top_decoded: list[str] | None = None


@dataclass
class EngineCoreOutput:
    """Per-step delta of one sequence, token ids only (engines never see text)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    # Complete list once, when the prompt is fully computed (index 0 is None: no context).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # Why it failed: "invalid" (the request itself; HTTP 400), "unavailable" (the serving side
    # could not run it, e.g. a remote prefill failed under policy `fail`; HTTP 503) or "internal"
    # (its step raised and it was failed alone: engine/core/step_faults.py; HTTP 500).
    error_kind: str = "invalid"
    queue_time: float | None = None  # seconds from arrival to first schedule; on the first tokens only
    # Prefill side of disaggregated serving: the finished request's KV, read out (kv_transfer.KVBlocks).
    kv_blocks: object | None = None
    # An embedding request (SamplingParams.pooling): its pooled, L2-normalised float32 vector, on
    # the output that finishes it.
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Streaming: what is new since the previous RequestOutput for this request.
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine failed this request (finish_reason "error")
    error_kind: str = "invalid"  # see EngineCoreOutput.error_kind
    metrics: dict = field(default_factory=dict)  # arrival, first token, finish times (monotonic)
    embedding: list[float] | None = None  # an embedding request's vector, once finished


@dataclass
class EmbeddingOutput:
    """What `LLM.embed` returns per prompt: the pooled, L2-normalised final hidden states."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]
    num_cached_tokens: int = 0
