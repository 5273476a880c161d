"""Reasoning in a model's output, for chat completions (`reasoning_parser` in AppConfig).

Both parsers read `<think>...</think>` blocks, as vLLM's and SGLang's parsers of the same names:
the text before the first `</think>` is the reasoning (`reasoning_content`), the text after it the
answer (`content`, where tool-call parsing applies). An opening `<think>` is optional, since
DeepSeek-R1's template and Qwen3.5's open the block in the prompt; `<think>` in the reasoning is
dropped, so neither tag reaches either field. An output that never closes the block (cut by
max_tokens) is all reasoning, as vLLM returns it.

`deepseek_r1`: always as above. `qwen3`: the same, except that a request with
`chat_template_kwargs` `{"enable_thinking": false}` (its template then closes an empty block in the
prompt) has no reasoning at all: the whole output is content.

`split(text)` splits a finished output; `ReasoningStream` splits a streamed one, holding back a
tail that may be the start of a tag, and its deltas add up to `split`'s two parts.
"""

from __future__ import annotations

from typing import Callable, Sequence

START, END = "<think>", "</think>"


def _partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `tags`."""
    for k in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-k:]) for tag in tags):
            return k
    return 0


def _split(text: str, final: bool) -> tuple[str, str]:
    """(reasoning, content) of `text`; not `final`: only what no later text can change."""
    end = text.find(END)
    if end >= 0:
        region, content = text[:end], text[end + len(END) :]
    else:
        region, content = text, ""
        if not final:  # a tag may be arriving: hold it back
            region = region[: len(region) - _partial_tag(region, (START, END))]
    return region.replace(START, ""), content


class ReasoningParser:
    """One request's parser: `name` from AppConfig, `thinking` false when the request turned
    reasoning off (qwen3's enable_thinking)."""

    def __init__(self, name: str, chat_template_kwargs: dict | None = None) -> None:
        self.name = name
        kwargs = chat_template_kwargs or {}
        self.thinking = not (name == "qwen3" and kwargs.get("enable_thinking", True) is False)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a finished output; an empty part is None, as vLLM
        returns it."""
        if not self.thinking:
            return None, text
        reasoning, content = _split(text, final=True)
        return reasoning or None, content or None

    def reasoning_tokens(self, token_ids: Sequence[int], token_text: Callable[[int], str]) -> int:
        """The output's tokens up to and including the one that completes `</think>` (all of them
        while the block is open; none with reasoning off): usage's `reasoning_tokens`."""
        if not self.thinking:
            return 0
        text = ""
        for k, t in enumerate(token_ids):
            piece = token_text(t)
            text = text[-len(END) :] + piece  # a tag may straddle tokens
            if END in text:
                return k + 1
        return len(token_ids)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """The deltas of one streamed output: `delta(text)` takes the whole text so far and returns
    the (reasoning, content) not sent before; `finish(text)` the rest. `content` is the
    content so far, whole (what the tool-call splitter reads)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.reasoning_sent = 0
        self.content = ""

    def delta(self, text: str, final: bool = False) -> tuple[str, str]:
        if not self.parser.thinking:
            reasoning, content = "", text
        else:
            reasoning, content = _split(text, final)
        r, c = reasoning[self.reasoning_sent :], content[len(self.content) :]
        self.reasoning_sent, self.content = max(self.reasoning_sent, len(reasoning)), self.content + c
        return r, c

    def finish(self, text: str) -> tuple[str, str]:
        return self.delta(text, final=True)
