"""Tool calls in a model's own syntax, for tool_choice "auto" (`tool_call_parser` in AppConfig).

`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after optional text,
as Hermes 2 Pro, Qwen2.5 and Qwen3 write them (their chat templates render `tools`). The text
before the first block is the message content.

`llama3_json`: the whole output is one or more `{"name": ..., "parameters": {...}}` objects
(separated by `;`, optionally after `<|python_tag|>`), as Llama 3.1-3.3 write them with their
JSON tool prompt; anything else is text.

Output whose calls do not all parse stays text, as vLLM's parsers leave it.
"""

from __future__ import annotations

import json
import re

START, END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_BLOCK = re.compile(re.escape(START) + r"\s*(.*?)\s*" + re.escape(END), re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments JSON)]) of a complete output; no calls: (text, [])."""
    start = text.find(START)
    if start < 0:
        return text, []
    calls = [_call(block) for block in _BLOCK.findall(text[start:])]
    if not calls or None in calls or text[start:].count(START) != len(calls):  # unclosed: cut by max_tokens
        return text, []
    content = text[:start].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(None, [(name, arguments JSON)]) when the whole output is calls; else (text, [])."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, i = decoder.raw_decode(body, i)
        except ValueError:
            return text, []
        call = _call(obj)
        if call is None:
            return text, []
        calls.append(call)
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return (None, calls) if calls else (text, [])


def _call(obj: object) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call, a JSON text or a decoded object; None if it is not one."""
    try:
        call = json.loads(obj) if isinstance(obj, str) else obj
        name, args = call["name"], call.get("arguments", call.get("parameters", {}))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return (name, json.dumps(args)) if isinstance(name, str) and isinstance(args, dict) else None


def parse(parser: str, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    return parse_llama3_json(text) if parser == "llama3_json" else parse_hermes(text)


class ContentStream:
    """The content deltas of a streamed output before its first tool-call block: text is held
    back while its end could be the start of `<tool_call>`, and from the block on nothing is
    sent (the calls go out whole at the end)."""

    def __init__(self, parser: str = "hermes") -> None:
        self.parser = parser
        self.sent = 0
        self.in_calls = False

    def delta(self, text: str) -> str:
        if self.in_calls:
            return ""
        if self.parser == "llama3_json":  # calls only from the start: decided by its first characters
            head = text.lstrip()
            if not self.sent and (head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head)):
                self.in_calls = head.startswith(("{", PYTHON_TAG))
                return ""
            out, self.sent = text[self.sent :], len(text)
            return out
        start = text.find(START, max(0, self.sent - len(START)))
        if start >= 0:
            self.in_calls = True
            end = start
        else:
            end = len(text)
            for k in range(min(len(START) - 1, len(text)), 0, -1):
                if START.startswith(text[-k:]):
                    end = len(text) - k
                    break
        out, self.sent = text[self.sent : end], max(self.sent, end)
        return out

    def rest(self, text: str, has_calls: bool) -> str:
        """The content left to send at the end (all the unsent text when no call parsed)."""
        return "" if has_calls else text[self.sent :]
