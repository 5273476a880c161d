"""Tool calls in a model's own syntax, for tool_choice "auto" (`tool_call_parser` in AppConfig).

`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after optional text,
as Hermes 2 Pro, Qwen2.5 and Qwen3 write them (their chat templates render `tools`). The text
before the first block is the message content. Output whose blocks do not all parse stays text,
as vLLM's parser leaves it.
"""

from __future__ import annotations

import json
import re

PARSERS = ("hermes",)
START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"\s*(.*?)\s*" + re.escape(END), re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments JSON)]) of a complete output; no calls: (text, [])."""
    start = text.find(START)
    if start < 0:
        return text, []
    calls = []
    for block in _BLOCK.findall(text[start:]):
        try:
            call = json.loads(block)
            name, args = call["name"], call.get("arguments", call.get("parameters", {}))
        except (ValueError, KeyError, TypeError, AttributeError):
            return text, []
        if not isinstance(name, str) or not isinstance(args, dict):
            return text, []
        calls.append((name, json.dumps(args)))
    if not calls or text[start:].count(START) != len(calls):  # an unclosed block: cut by max_tokens
        return text, []
    content = text[:start].strip()
    return content or None, calls


class ContentStream:
    """The content deltas of a streamed output before its first tool-call block: text is held
    back while its end could be the start of `<tool_call>`, and from the block on nothing is
    sent (the calls go out whole at the end)."""

    def __init__(self) -> None:
        self.sent = 0
        self.in_calls = False

    def delta(self, text: str) -> str:
        if self.in_calls:
            return ""
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
