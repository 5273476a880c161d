"""OpenAI API bodies (pydantic): /v1/completions, /v1/chat/completions, /v1/models.

Requests accept the OpenAI fields plus the usual vLLM extensions (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, ...). Unknown fields are ignored,
as OpenAI-compatible servers do. Streaming chunks are built as plain dicts in openai_api.py.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # NaN/inf: 400, not a sampler fault


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# Bounds as SamplingParams checks them, so the schema (clients, fuzzers) knows what is valid.
StopStrings = Annotated[list[str], Field(max_length=16)]
TokenId = Annotated[int, Field(ge=0)]
MaxTokens = Annotated[int, Field(ge=1)]
TopLogprobs = Annotated[int, Field(ge=0, le=20)]


class JsonSchemaFormat(_Request):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="A JSON schema; none: any JSON.")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema.")
    json_object: bool | None = Field(None, description="true: any JSON object.")
    regex: str | None = None
    choice: list[str] | None = Field(None, description="The output is exactly one of these strings.")
    grammar: str | None = Field(None, description="A Lark or GBNF grammar.")


class _SamplingFields(_Request):
    """Fields both endpoints share; names as in the OpenAI API (+ vLLM extensions)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128, description="Completions per prompt.")
    temperature: float | None = Field(None, ge=0, description="0 = greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: disabled (extension).")
    min_p: float | None = Field(None, ge=0, le=1, description="Extension.")
    typical_p: float | None = Field(None, gt=0, le=1, description="Extension: locally typical sampling's mass.")
    watermark: bool = Field(False, description="Extension (TGI's): green-list watermark with the deployment's key.")
    truncate_prompt_tokens: int | None = Field(
        None, ge=1, description="Extension (vLLM's): keep only the last N prompt tokens."
    )
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, description="Extension.")
    seed: int | None = None
    stop: str | StopStrings | None = None
    stop_token_ids: list[TokenId] | None = Field(None, description="Extension.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="Extension: keep generating past EOS.")
    min_tokens: int = Field(0, ge=0, description="Extension.")
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="Token id (as a string) -> bias added to its logit, in [-100, 100]."
    )
    user: str | None = Field(
        None, max_length=256, description="The end user: logged with the request id (Serve's log) for abuse reviews."
    )
    priority: int = Field(0, description="Extension: lower runs first under the priority policy.")
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="Extension (vLLM's): only requests with the same salt share prefix-cache blocks, so "
        "one tenant cannot learn from cached_tokens what another's prompts were.",
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(
        None, description="Extension (vLLM's): the output must match exactly one of these."
    )
    # vLLM's older spellings of structured_outputs, which many clients still send.
    guided_json: dict[str, Any] | str | None = Field(None, description="Alias of structured_outputs.json.")
    guided_regex: str | None = Field(None, description="Alias of structured_outputs.regex.")
    guided_choice: list[str] | None = Field(None, description="Alias of structured_outputs.choice.")
    guided_grammar: str | None = Field(None, description="Alias of structured_outputs.grammar.")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="A string, a list of strings, token ids, or a list of token-id lists."
    )
    max_tokens: MaxTokens | None = 16
    logprobs: TopLogprobs | None = Field(None, description="Top logprobs per token (0-20).")
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str = "{}"


class ToolCall(_Request):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant turn's calls (rendered by the template).")
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(_Request):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments; none: any object.")
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: MaxTokens | None = Field(None, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: 'auto' with tools (which needs a tool-call parser: refused), else 'none'."
    )
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


# --- responses --------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "orbital"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class WatermarkDetectRequest(_Request):
    text: str | None = Field(None, min_length=1, description="The text to score (tokenized as the model does).")
    token_ids: list[TokenId] | None = Field(None, min_length=2, description="Or its token ids.")
