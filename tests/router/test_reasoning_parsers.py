"""The reasoning splitter (router/ingress/reasoning_parsers.py), no Ray: a finished output's
split, and the streamed split under every chunking of the text adding up to the same two parts,
with no tag in either."""

from __future__ import annotations

import itertools

import pytest

from router.config import REASONING_PARSERS
from router.ingress.reasoning_parsers import ReasoningParser

# text -> (reasoning_content, content) under deepseek_r1 (and qwen3 with thinking on)
CASES = {
    "<think>Let me see.</think>The answer is 4.": ("Let me see.", "The answer is 4."),
    "<think>\nhmm\n</think>\n\nHi": ("\nhmm\n", "\n\nHi"),
    # DeepSeek-R1's template opens the block in the prompt: the output starts inside it.
    "Let me see.</think>Four.": ("Let me see.", "Four."),
    # Cut by max_tokens inside the block: all reasoning, no content (vLLM).
    "<think>Let me": ("Let me", None),
    "no tags at all": ("no tags at all", None),
    "<think></think>Just the answer.": (None, "Just the answer."),
    "<think>a</think>": ("a", None),
    "<think>a <b> c</think>x < y </think> z": ("a <b> c", "x < y </think> z"),
    "<think>a<think>b</think>c": ("ab", "c"),
    "": (None, None),
}


@pytest.mark.parametrize("name", REASONING_PARSERS)
@pytest.mark.parametrize("text", list(CASES))
def test_finished_output(name, text):
    assert ReasoningParser(name).split(text) == CASES[text]


def test_qwen3_without_thinking_has_no_reasoning():
    off = ReasoningParser("qwen3", {"enable_thinking": False})
    for text in CASES:
        assert off.split(text) == (None, text)
    assert ReasoningParser("qwen3", {"enable_thinking": True}).split("a</think>b") == ("a", "b")
    # deepseek_r1's templates have no such switch.
    assert ReasoningParser("deepseek_r1", {"enable_thinking": False}).split("a</think>b") == ("a", "b")


def _chunkings(text: str):
    """Every way to cut `text` into at most three pieces (every pair of cut positions)."""
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        yield [text[:i], text[:j], text]


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}])
@pytest.mark.parametrize("name", REASONING_PARSERS)
@pytest.mark.parametrize("text", list(CASES))
def test_every_chunking_streams_the_same_split(name, text, kwargs):
    parser = ReasoningParser(name, kwargs)
    want = tuple(x or "" for x in parser.split(text))
    for prefixes in _chunkings(text):
        stream = parser.stream()
        reasoning = content = ""
        for k, seen in enumerate(prefixes):
            r, c = stream.finish(seen) if k == len(prefixes) - 1 else stream.delta(seen)
            assert "think>" not in r, (prefixes, r)
            assert "think>" not in c or "think>" in want[1], (prefixes, c)
            reasoning, content = reasoning + r, content + c
            assert stream.content == content
        assert (reasoning, content) == want, prefixes


def test_a_tag_split_across_deltas_is_held_back():
    stream = ReasoningParser("deepseek_r1").stream()
    assert stream.delta("<thi") == ("", "")
    assert stream.delta("<think>Hm</th") == ("Hm", "")
    assert stream.delta("<think>Hm</think>O") == ("", "O")
    assert stream.finish("<think>Hm</think>OK<") == ("", "K<")
    # An unfinished tag at the end of the output is text.
    assert ReasoningParser("deepseek_r1").stream().finish("Hm</thin") == ("Hm</thin", "")


# A streamed chat with reasoning_parser deepseek_r1 and tool_call_parser hermes, its output cut
# into engine steps every way: the deltas add up to the finished split, and a call inside the
# reasoning is never one.
CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
STREAMED = {
    f"<think>a {CALL}</think>Hi {CALL}": ("a " + CALL, "Hi", ["f"]),
    f"<think>a {CALL}</think>b<tool": ("a " + CALL, "b<tool", []),
    "<think>r</think>": ("r", "", []),
}


def _steps(text: str, cuts: list[int]):
    from engine.outputs import CompletionOutput, RequestOutput

    bounds = [0, *cuts, len(text)]
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        last = k == len(bounds) - 2
        out = CompletionOutput(0, text[:b], [], finish_reason="stop" if last else None, text_delta=text[a:b])
        yield RequestOutput("r", None, [1], [out], finished=last)


@pytest.mark.parametrize("text", list(STREAMED))
def test_streamed_chat_with_tools_adds_up(text):
    import asyncio

    from router.ingress.openai_api import OpenAIServing
    from router.ingress.openai_models import ChatCompletionRequest
    from router.ingress.openai_tools import ToolMode

    body = {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]}
    req = ChatCompletionRequest.model_validate({**body, "stream": True})
    serving = OpenAIServing(None, "m", 64, "hermes", reasoning_parser="deepseek_r1")
    reasoning_parser = ReasoningParser("deepseek_r1")

    async def run(cuts) -> tuple[str, str, list[str]]:
        async def stream():
            for out in _steps(text, cuts):
                yield out

        reasoning, content, calls = "", "", []
        async for chunk in serving._stream_chat(req, "r", "m", 1, stream(), ToolMode(req, "hermes"), reasoning_parser):
            for ch in chunk["choices"]:
                delta = ch["delta"]
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
                calls += [c["function"]["name"] for c in delta.get("tool_calls") or []]
        return reasoning, content.strip(), calls

    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        assert asyncio.run(run([i, j])) == STREAMED[text], (i, j)
