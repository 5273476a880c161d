"""Tool calls in chat completions, held to the tools' schemas by structured outputs.

`tool_choice` a named function: the output is that function's arguments, a JSON object of its
`parameters` schema. `"required"`: a JSON array of one or more calls (one when
`parallel_tool_calls` is false), each `{"name": ..., "parameters": {...}}` of one of the tools.
Either way the grammar guarantees calls that parse and match their schemas, whatever the model's
own tool-call format, and the response carries them as `tool_calls` (finish_reason
"tool_calls"). `"none"`: plain text. `"auto"` (the default when tools are given) needs a
parser of the model's own tool-call syntax to tell calls from text (`tool_call_parser`,
tool_parsers.py); without one it is refused with a 400 naming the alternatives, as vLLM does.
The tools go to the chat template (`tools=`), for templates that render them.
"""

from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING, Iterable

from engine.errors import InvalidRequestError
from engine.structured.spec import StructuredOutput
from router.ingress.openai_models import ChatCompletionRequest, ChatMessage, NamedToolChoice
from router.ingress.tool_parsers import parse

if TYPE_CHECKING:
    from engine.text.input_processor import InputProcessor
    from router.ingress.openai_models import FunctionDefinition

ANY_OBJECT = {"type": "object"}


class ToolMode:
    """How one request uses its tools: `named` (one function) or `required` (a list of calls)."""

    def __init__(self, req: ChatCompletionRequest, parser: str | None = None) -> None:
        self.tools = {t.function.name: t.function for t in req.tools or []}
        if len(self.tools) != len(req.tools or []):
            raise InvalidRequestError("tool names must be unique", param="tools")
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if self.tools else "none")
        self.named: str | None = None
        self.required = False
        self.auto = False  # calls in the model's own syntax, told from text by the parser
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in self.tools:
                raise InvalidRequestError(
                    f"tool_choice names no tool of the request: {choice.function.name!r}", "tool_choice"
                )
            self.named = choice.function.name
        elif choice == "required":
            if not self.tools:
                raise InvalidRequestError("tool_choice 'required' needs tools", param="tool_choice")
            self.required = True
        elif choice == "auto" and self.tools:
            if parser is None:
                raise InvalidRequestError(
                    "tool_choice 'auto' needs a parser of this model's tool-call format (the server's "
                    "tool_call_parser), which is not configured; use tool_choice 'required' or a named "
                    "function (the output is then held to the tools' schemas)",
                    param="tool_choice",
                )
            self.auto = True
        self.parser = parser
        self.single = not req.parallel_tool_calls

    @property
    def active(self) -> bool:
        return self.named is not None or self.required or self.auto

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates take them (None: no tools)."""
        return template_tools(self.tools.values())

    def constraint(self) -> StructuredOutput | None:
        if self.named is not None:
            return StructuredOutput("json", self.tools[self.named].parameters or ANY_OBJECT, param="tools")
        if not self.required:
            return None
        call = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": f.parameters or ANY_OBJECT},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, f in self.tools.items()
            ]
        }
        calls = {"type": "array", "items": call, "minItems": 1}
        if self.single:
            calls["maxItems"] = 1
        return StructuredOutput("json", calls, param="tools")

    def split(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict] | None]:
        """(content, tool_calls) of a finished output; no calls: (text, None)."""
        if self.auto:
            content, calls = parse(self.parser, text)
            return (content, [_call(n, a) for n, a in calls]) if calls else (text, None)
        calls = self._held_calls(text) if finish_reason == "stop" else None
        return (None, calls) if calls else (text, None)

    def _held_calls(self, text: str) -> list[dict] | None:
        """The tool_calls of an output its grammar ended; None where it is not a whole call
        (a stop string of the request cut it)."""
        try:
            value = json.loads(text)
            if self.named is not None:
                return [_call(self.named, text)] if isinstance(value, dict) else None
            return [_call(c["name"], json.dumps(c["parameters"])) for c in value]
        except (ValueError, KeyError, TypeError):
            return None


def _call(name: str, arguments: str) -> dict:
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def request_message(m: ChatMessage) -> dict:
    """A request message as chat templates take it (tool calls and ids for templates that use them)."""
    out = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": t.id, "type": "function", "function": {"name": t.function.name, "arguments": t.function.arguments}}
            for t in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def assistant_message(text: str, finish_reason: str | None, tools: ToolMode) -> tuple[dict, str | None]:
    """The response message and finish reason: tool calls where the output has whole calls,
    else the text (a call cut by max_tokens stays text, "length")."""
    if not tools.active:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = tools.split(text, finish_reason)
    if calls:
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text, "tool_calls": []}, finish_reason


def template_tools(functions: Iterable[FunctionDefinition]) -> list[dict] | None:
    """Function definitions as chat templates take them (None: no tools)."""
    out = [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in functions]
    return out or None


def chat_template_arguments(
    inputs: InputProcessor,
    requested: dict | None,
    tools: list[dict] | None,
    continue_final_message: bool,
    add_generation_prompt: bool,
) -> dict:
    """apply_chat_template's keyword arguments for a chat request: the template variables the
    client may set, the tools, and how the last turn ends (chat completions and /tokenize)."""
    kwargs = inputs.template_variables(requested or {})
    if tools:
        kwargs["tools"] = tools
    if continue_final_message:
        kwargs["continue_final_message"] = True
    kwargs["add_generation_prompt"] = add_generation_prompt and not continue_final_message
    return kwargs
