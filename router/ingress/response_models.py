"""Success bodies of every route, as pydantic models: what `/openapi.json` documents for 200.

The handlers build their answers as plain dicts (cheaper per streamed chunk than model
instances); these models describe the same shapes, and the tests validate real answers against
them (and schemathesis checks every answer against the schema), so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, RootModel

from router.ingress.openai_models import ModelList
from router.ingress.responses_models import ResponseDeleted, ResponseObject, ResponseStreamEvent
from router.ingress.tgi_models import Details, StreamResponse

FinishReason = Literal["stop", "length", "abort", "error"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(..., description="Prompt tokens served from the prefix cache.")


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = Field(
        ..., description="Output tokens up to the end of the reasoning block (a pool with a reasoning_parser)."
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None


# --- /v1/completions --------------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = Field(None, description="The stop string or token id that ended it.")


class CompletionResponse(BaseModel):
    """Non-streamed answer; streamed, every `data:` event is a CompletionChunk."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, description="Only on the last chunk, with stream_options.include_usage.")


# --- /v1/chat/completions ---------------------------------------------------------------------


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = Field(
        None, description="The model's reasoning, apart from `content` (a server with a reasoning_parser)."
    )


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """Non-streamed answer; streamed, every `data:` event is a ChatCompletionChunk."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = Field(None, description="Reasoning text (a server with a reasoning_parser).")


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="Only on the last chunk, with stream_options.include_usage.")


# --- TGI --------------------------------------------------------------------------------------


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = Field(None, description="With parameters.details.")


class GenerateResponses(RootModel[list[GenerateResponse]]):
    """POST / without `stream`: TGI's compat route answers a list of one."""


class Info(BaseModel):
    model_id: str
    model_dtype: str
    model_device_type: str
    max_concurrent_requests: int
    max_input_tokens: int
    max_total_tokens: int
    version: str
    model_pipeline_tag: str
    router: str
    max_best_of: int
    max_stop_sequences: int
    validation_workers: int
    max_client_batch_size: int
    model_sha: str | None
    sha: str | None
    docker_label: str | None


class WatermarkDetection(BaseModel):
    object: Literal["watermark.detection"]
    num_tokens: int = Field(..., description="Tokens scored: every token after the first.")
    num_green: int = Field(..., description="Of those, the ones in their predecessor's green list.")
    z_score: float
    p_value: float = Field(..., description="The chance that text without the watermark scores this high.")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int = Field(..., description="The pool's context length (prompt and output together).")
    tokens: list[int]
    token_strs: list[str] | None = Field(..., description="Each token's text, with return_token_strs.")


class DetokenizeResponse(BaseModel):
    prompt: str


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(
        ..., description="Numbers, or with encoding_format base64 their float32 bytes."
    )


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# --- operations -------------------------------------------------------------------------------


class PoolHealth(BaseModel):
    status: Literal["ok", "unavailable"]
    replicas: int
    expected_replicas: int
    unhealthy: list[str] = Field(..., description="Replicas that did not answer their health check.")


class Health(PoolHealth):
    """200 when every pool is ok, else 503 with the same body."""

    pools: dict[str, PoolHealth]


class ReplicaLoad(BaseModel):
    """An engine replica's figures, from its `stats`."""

    num_running: int = Field(..., description="Sequences in its running batch.")
    num_waiting: int = Field(..., description="Sequences not scheduled yet (preempted ones included).")
    kv_usage: float = Field(..., description="Used KV blocks / its KV blocks (1 = full).")
    blocks_used: int
    num_blocks: int
    prefix_cache_queries: int = Field(..., description="Prompt tokens looked up in the prefix cache, since start.")
    prefix_cache_hits: int = Field(..., description="Of those, the tokens found (every tier).")
    prefix_hit_rate: float = Field(..., description="prefix_cache_hits / prefix_cache_queries (0 with none).")
    prompt_tokens: int = Field(..., description="Prompt tokens received, since start.")
    generation_tokens: int = Field(..., description="Tokens generated, since start.")
    queued: int = Field(..., description="Requests in its queue with no output yet.")
    in_flight: int = Field(..., description="Requests it holds.")


class ReplicaRouting(BaseModel):
    """What this router replica sent to an engine replica (cache-aware routing), since start."""

    routed: int
    predicted_cached_tokens: int = Field(..., description="Prompt tokens the router expected cached there.")
    actual_cached_tokens: int = Field(..., description="Prompt tokens the replica reported found in its cache.")


class ReplicaState(BaseModel):
    replica_id: str
    healthy: bool = Field(..., description="It answered its health check.")
    error: str | None = Field(..., description="Why its health check failed.")
    node_id: str | None
    load: ReplicaLoad | None = Field(..., description="None when its stats did not arrive.")
    routing: ReplicaRouting | None = Field(..., description="None until this router replica sent it a request.")


class PoolTotals(BaseModel):
    """Sums over the pool's replicas whose stats arrived (as /metrics sums them)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_hit_rate: float


class PoolRouter(BaseModel):
    """This router replica's queue for the pool, and its failover counts."""

    queued: int
    in_flight: int
    rejected: int
    migrations: int
    migration_failures: int


class PoolState(BaseModel):
    name: str
    role: Literal["decode", "prefill"] | None = Field(..., description="In a disaggregated app; else None.")
    status: Literal["ok", "unavailable"] = Field(..., description="As /health says it.")
    expected_replicas: int
    replicas: list[ReplicaState]
    totals: PoolTotals
    router: PoolRouter | None = Field(..., description="None for a pool this router sends no requests to.")


class ClusterState(BaseModel):
    """GET /cluster/state: what the web page (GET /) shows."""

    status: Literal["ok", "unavailable"]
    pools: list[PoolState]


JSON = "application/json"
SSE = "text/event-stream"
# (path, method) -> {content type: model}. The SSE entries describe one `data:` event; a stream
# of the OpenAI routes ends with `data: [DONE]`.
SUCCESS: dict[tuple[str, str], dict[str, type[BaseModel]]] = {
    ("/v1/completions", "post"): {JSON: CompletionResponse, SSE: CompletionChunk},
    ("/v1/chat/completions", "post"): {JSON: ChatCompletionResponse, SSE: ChatCompletionChunk},
    ("/generate", "post"): {JSON: GenerateResponse},
    ("/generate_stream", "post"): {SSE: StreamResponse},
    ("/", "post"): {JSON: GenerateResponses, SSE: StreamResponse},
    ("/v1/responses", "post"): {JSON: ResponseObject, SSE: ResponseStreamEvent},
    ("/v1/responses/{response_id}", "get"): {JSON: ResponseObject},
    ("/v1/responses/{response_id}", "delete"): {JSON: ResponseDeleted},
    ("/v1/models", "get"): {JSON: ModelList},
    ("/info", "get"): {JSON: Info},
    ("/health", "get"): {JSON: Health},
    ("/cluster/state", "get"): {JSON: ClusterState},
    ("/v1/watermark/detect", "post"): {JSON: WatermarkDetection},
    ("/v1/embeddings", "post"): {JSON: EmbeddingResponse},
    ("/tokenize", "post"): {JSON: TokenizeResponse},
    ("/detokenize", "post"): {JSON: DetokenizeResponse},
}
