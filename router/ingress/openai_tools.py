"""Tool calls in chat completions, held to the tools' schemas by structured outputs.

`tool_choice` a named function: the output is that function's arguments, a JSON object of its
`parameters` schema. `"required"`: a JSON array of one or more calls (one when
`parallel_tool_calls` is false), each `{"name": ..., "parameters": {...}}` of one of the tools.
Either way the grammar guarantees calls that parse and match their schemas, whatever the model's
own tool-call format, and the response carries them as `tool_calls` (finish_reason
"tool_calls"). `"none"`: plain text. `"auto"` (the default when tools are given) would need a
parser of the model's own tool-call syntax to tell calls from text: refused with a 400 naming
the alternatives, as vLLM does without a configured parser. The tools go to the chat template
(`tools=`), for templates that render them.
"""

from __future__ import annotations

import json
import secrets

from engine.errors import InvalidRequestError
from engine.structured.spec import StructuredOutput
from router.ingress.openai_models import ChatCompletionRequest, NamedToolChoice

ANY_OBJECT = {"type": "object"}


class ToolMode:
    """How one request uses its tools: `named` (one function) or `required` (a list of calls)."""

    def __init__(self, req: ChatCompletionRequest) -> None:
        self.tools = {t.function.name: t.function for t in req.tools or []}
        if len(self.tools) != len(req.tools or []):
            raise InvalidRequestError("tool names must be unique", param="tools")
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if self.tools else "none")
        self.named: str | None = None
        self.required = False
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
        elif choice == "auto":
            raise InvalidRequestError(
                "tool_choice 'auto' needs a parser of this model's tool-call format, which is not configured; "
                "use tool_choice 'required' or a named function (the output is then held to the tools' schemas)",
                param="tool_choice",
            )
        self.single = not req.parallel_tool_calls

    @property
    def active(self) -> bool:
        return self.named is not None or self.required

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates take them (None: no tools)."""
        if not self.tools:
            return None
        return [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.tools.values()]

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

    def calls(self, text: str) -> list[dict] | None:
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
