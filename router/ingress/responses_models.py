"""OpenAI Responses API bodies (pydantic): the request of `POST /v1/responses`, the Response
object and its streamed events.

The request declares every field OpenAI's API defines: the ones Orbital does are typed as
they act, the others are typed loosely and refused with a 400 naming them
(`ResponsesRequest.refused`), so that no field is accepted and ignored. Fields OpenAI does not
define are ignored, as on the other OpenAI routes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, RootModel

from router.ingress.openai_models import MaxTokens


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# --- request ----------------------------------------------------------------------------------


class InputText(_Request):
    type: Literal["input_text", "output_text"] = Field(
        ..., description="output_text: an assistant turn's text, as a previous response's output carries it."
    )
    text: str


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem]


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments; none: any object.")
    strict: bool | None = None


class FunctionChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = Field(None, max_length=64, description="json_schema: the schema's name.")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="json_schema: the JSON schema.")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Any = Field(None, description="Refused: the model has no verbosity setting.")


# Fields of OpenAI's API that Orbital does not do: a request that sets them is refused.
REFUSED = {
    "background": "background responses are not supported",
    "conversation": "conversations are not supported; chain responses with previous_response_id",
    "include": "include is not supported (no encrypted reasoning, search results or logprobs to add)",
    "max_tool_calls": "max_tool_calls is not supported",
    "prompt": "prompt templates are not supported",
    "prompt_cache_key": "prompt_cache_key is not supported (the prefix cache needs no key)",
    "prompt_cache_retention": "prompt_cache_retention is not supported",
    "reasoning": "reasoning options are not supported",
    "safety_identifier": "safety_identifier is not supported; use user",
    "service_tier": "service_tier is not supported",
    "stream_options": "stream_options is not supported (events carry no obfuscation)",
    "top_logprobs": "top_logprobs is not supported on /v1/responses; use /v1/chat/completions",
}


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)] = Field(
        ..., description="A user message, or a list of messages and function_call / function_call_output items."
    )
    instructions: str | None = Field(None, description="A system message before the input (not carried over).")
    previous_response_id: str | None = Field(
        None, description="Continue a stored response: its input and output come before this input."
    )
    store: bool = Field(True, description="Keep the response (in this router replica's memory, for a bounded time).")
    stream: bool = False
    max_output_tokens: MaxTokens | None = None
    temperature: float | None = Field(None, ge=0, description="0 = greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = Field(None, max_length=128, description="Function tools only.")
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = Field(
        None, description="Default: 'auto' with tools (which needs the server's tool_call_parser), else 'none'."
    )
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = Field(None, description="Only 'disabled' (a long prompt is a 400).")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="Kept with the response.")
    user: str | None = Field(None, max_length=256, description="The end user: logged with the request id.")
    background: Any = None
    conversation: Any = None
    include: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    reasoning: Any = None
    safety_identifier: Any = None
    service_tier: Any = None
    stream_options: Any = None
    top_logprobs: Any = None

    def refused(self) -> tuple[str, str] | None:
        """(field, why) of the first field set that Orbital does not do."""
        for name, why in REFUSED.items():
            value = getattr(self, name)
            harmless = (name == "background" and value is False) or (name == "include" and value == [])
            if value is not None and not harmless:
                return name, why
        if self.text is not None and self.text.verbosity is not None:
            return "text.verbosity", "text.verbosity is not supported"
        return None


# --- the Response object ----------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class OutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class OutputReasoning(BaseModel):
    """The model's reasoning, where its pool has a reasoning_parser (whole, not summarised)."""

    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Union[OutputMessage, OutputFunctionCall, OutputReasoning]


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    """A response: `POST /v1/responses` without `stream`, `GET /v1/responses/{id}`, and the
    `response` of the stream's created / in_progress / completed events."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None
    error: None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    truncation: Literal["disabled"]
    previous_response_id: str | None
    store: bool
    metadata: dict[str, str]
    user: str | None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


# --- stream events ----------------------------------------------------------------------------


class _Event(BaseModel):
    sequence_number: int


class ResponseLifecycleEvent(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]


class ReasoningDeltaEvent(_Event):
    type: Literal["response.reasoning_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningDoneEvent(_Event):
    type: Literal["response.reasoning_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(_Event):
    """An error after the stream started (before it, the HTTP status says it)."""

    type: Literal["error"]
    code: str | None
    message: str
    param: str | None


class ResponseStreamEvent(
    RootModel[
        Union[
            ResponseLifecycleEvent,
            OutputItemEvent,
            ContentPartEvent,
            TextDeltaEvent,
            TextDoneEvent,
            ReasoningDeltaEvent,
            ReasoningDoneEvent,
            ArgumentsDeltaEvent,
            ArgumentsDoneEvent,
            ErrorEvent,
        ]
    ]
):
    """One streamed event: `event: <type>` and `data: <this>`; the stream ends after
    response.completed (or response.incomplete, or error) without `[DONE]`."""
