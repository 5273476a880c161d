"""Reasoning through a real server and the openai SDK: a model whose greedy output really is
`<think>The user asks</think>Hello!` (tests/tiny_llama.py, the thinking stand-in) served by two
pools, `r1` (reasoning_parser deepseek_r1, tool_call_parser hermes) and `q3` (qwen3). The block
goes to `reasoning_content` and only the answer to `content`, streamed and not; qwen3 with
enable_thinking false (the template closes the block in the prompt) has no reasoning; an output
that starts inside the block (a continued assistant message) splits the same; a tool call
written inside the block is no call; structured outputs and held tool calls (chat and the
Responses API) leave the reasoning free and hold the answer after `</think>` (the whole answer with
reasoning off)."""

from __future__ import annotations

import json

import pytest

from tests.router.conftest import BASE

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "Hi"}]
ANSWER = "Hello!"


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory, smollm_dir):
    from tests.tiny_llama import save_thinking_stand_in

    return str(save_thinking_stand_in(tmp_path_factory.mktemp("thinking"), smollm_dir))


@pytest.fixture(scope="module")
def reason_app(thinking_model):
    from tests.serve_cluster import serve_app

    pools = [
        {"name": "r1", "reasoning_parser": "deepseek_r1", "tool_call_parser": "hermes"},
        {"name": "q3", "reasoning_parser": "qwen3"},
    ]
    config = {**BASE, "kv_cache_memory_bytes": 8 << 20}
    with serve_app("reason", "/reason", **config, model=thinking_model, num_replicas=1, models=pools) as app:
        yield app["url"]


@pytest.fixture(scope="module")
def oai(reason_app):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{reason_app}/v1", api_key="unused", max_retries=0, timeout=120)


def _create(oai, model, stream=False, **kw):
    kw = {"max_tokens": 20, "temperature": 0, **kw}
    return oai.chat.completions.create(model=model, messages=ASK, stream=stream, **kw)


def _reasoning(message) -> str | None:
    return getattr(message, "reasoning_content", None)  # the SDK's models keep unknown fields as attributes


def _streamed(oai, model, **kw) -> tuple[str, str, str | None]:
    """(reasoning, content, finish_reason) of a streamed answer; no tag in any delta, and no
    reasoning after the content began."""
    reasoning = content = ""
    finish = None
    for chunk in _create(oai, model, stream=True, **kw):
        for ch in chunk.choices:
            r = _reasoning(ch.delta) or ""
            assert "think>" not in r and "think>" not in (ch.delta.content or ""), ch.delta
            assert not (r and content), (content, ch.delta)
            reasoning, content = reasoning + r, content + (ch.delta.content or "")
            finish = ch.finish_reason or finish
    return reasoning, content, finish


@pytest.mark.parametrize("model", ["r1", "q3"])
def test_reasoning_apart_from_the_answer(oai, model):
    r = _create(oai, model)
    msg = r.choices[0].message
    assert (msg.content, _reasoning(msg)) == (ANSWER, "The user asks"), msg
    assert r.choices[0].finish_reason == "stop"
    assert _streamed(oai, model) == ("The user asks", ANSWER, "stop")
    # Cut inside the block: all reasoning so far, no content.
    msg = _create(oai, model, max_tokens=3).choices[0].message
    assert (msg.content, _reasoning(msg)) == (None, "The user"), msg
    assert _streamed(oai, model, max_tokens=3) == ("The user", "", "length")


def test_qwen3_with_thinking_off_answers_only(oai):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    msg = _create(oai, "q3", extra_body=off).choices[0].message
    assert (msg.content, _reasoning(msg)) == (ANSWER, None), msg
    assert _streamed(oai, "q3", extra_body=off) == ("", ANSWER, "stop")


def test_an_output_that_starts_inside_the_block(oai):
    """A continued assistant message "The": the output ` user asks</think>Hello!` has no
    `<think>` (DeepSeek-R1's template opens the block in the prompt)."""
    history = ASK + [{"role": "assistant", "content": "The"}]
    cont = {"continue_final_message": True, "add_generation_prompt": False}
    r = oai.chat.completions.create(model="r1", messages=history, max_tokens=20, temperature=0, extra_body=cont)
    msg = r.choices[0].message
    assert (msg.content, _reasoning(msg)) == (ANSWER, " user asks"), msg


def test_tool_calls_are_read_from_the_content_only(oai):
    """A continued assistant message "Wait": the model writes a hermes call inside the block,
    `<tool_call>{"name":"f","arguments":{}}</tool_call></think>Hello!`. The call is reasoning, not
    a call; the content holds none."""
    f = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    history = ASK + [{"role": "assistant", "content": "Wait"}]
    kw = {
        "messages": history,
        "tools": [f],
        "extra_body": {"continue_final_message": True, "add_generation_prompt": False},
    }
    call = '<tool_call>{"name":"f","arguments":{}}</tool_call>'
    r = oai.chat.completions.create(model="r1", max_tokens=30, temperature=0, **kw)
    msg = r.choices[0].message
    assert (msg.content, _reasoning(msg), msg.tool_calls) == (ANSWER, call, []), msg
    assert r.choices[0].finish_reason == "stop"
    reasoning = content = ""
    for chunk in oai.chat.completions.create(model="r1", max_tokens=30, temperature=0, stream=True, **kw):
        for ch in chunk.choices:
            assert not ch.delta.tool_calls, ch.delta
            reasoning, content = reasoning + (_reasoning(ch.delta) or ""), content + (ch.delta.content or "")
    assert (reasoning, content) == (call, ANSWER)
    # The same calls in the content are calls: the plain answer with tools stays text.
    r = _create(oai, "r1", tools=[f])
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls) == (ANSWER, [])


# The stand-in's answer "Hello!" is no JSON: once the grammar holds the answer, every other
# token scores the same and the mask decides it.
YES_NO = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": YES_NO}}


def _yes_no(text: str | None) -> bool:
    return json.loads(text) in ({"answer": "yes"}, {"answer": "no"})


@pytest.mark.parametrize("model", ["r1", "q3"])
@pytest.mark.parametrize(
    "extra, matches",
    [
        ({"response_format": SCHEMA}, _yes_no),
        ({"extra_body": {"structured_outputs": {"json": YES_NO}}}, _yes_no),
        ({"extra_body": {"guided_regex": "(yes|no)!"}}, lambda text: text in ("yes!", "no!")),
    ],
    ids=["response_format", "structured_outputs", "guided_regex"],
)
def test_a_grammar_holds_the_answer_after_the_reasoning(oai, model, extra, matches):
    """The reasoning is as without a grammar; the content after `</think>` matches it."""
    r = _create(oai, model, max_tokens=40, **extra)
    msg = r.choices[0].message
    assert _reasoning(msg) == "The user asks" and r.choices[0].finish_reason == "stop", msg
    assert matches(msg.content), msg.content
    assert _streamed(oai, model, max_tokens=40, **extra) == ("The user asks", msg.content, "stop")
    # Cut inside the block: the grammar never began.
    msg = _create(oai, model, max_tokens=3, **extra).choices[0].message
    assert (msg.content, _reasoning(msg)) == (None, "The user"), msg


def test_a_grammar_with_reasoning_off_holds_the_whole_answer(oai):
    """qwen3 with enable_thinking false: the prompt closed the block, the grammar starts at once."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = _create(oai, "q3", max_tokens=40, response_format=SCHEMA, extra_body=off)
    msg = r.choices[0].message
    assert _reasoning(msg) is None and r.choices[0].finish_reason == "stop", msg
    assert _yes_no(msg.content), msg.content


def test_held_tool_calls_come_after_the_reasoning(oai):
    """tool_choice "required" and a named function: the calls are read from the content, which
    the tools' schemas hold after `</think>`; the reasoning stays free. One call at most: the
    stand-in's mask-decided answer would add calls to max_tokens."""
    params = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    f = {"type": "function", "function": {"name": "f", "parameters": params}}
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        r = oai.chat.completions.create(
            model="r1",
            messages=ASK,
            tools=[f],
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=60,
            temperature=0,
        )
        msg = r.choices[0].message
        assert (_reasoning(msg), msg.content, r.choices[0].finish_reason) == ("The user asks", None, "tool_calls")
        assert [c.function.name for c in msg.tool_calls] == ["f"], msg
        assert json.loads(msg.tool_calls[0].function.arguments)["city"] in ("Paris", "Rome"), msg


def test_responses_api_text_format_holds_the_answer_after_the_reasoning(oai):
    fmt = {"format": {"type": "json_schema", "name": "yes_no", "schema": YES_NO}}
    r = oai.responses.create(model="r1", input="Hi", max_output_tokens=40, temperature=0, text=fmt)
    assert [item.type for item in r.output] == ["reasoning", "message"], r.output
    assert r.output[0].content[0].text == "The user asks" and r.status == "completed"
    assert _yes_no(r.output_text), r.output_text


# "<think>", "The", " user", " asks", "</think>": the tokens up to the one that closes the block.
REASONING_TOKENS = 5


def test_usage_counts_the_reasoning_tokens(oai):
    usage = _create(oai, "r1").usage
    assert usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS, usage
    assert usage.completion_tokens > REASONING_TOKENS  # the answer's tokens come after
    cut = _create(oai, "r1", max_tokens=3).usage  # inside the block: every token is reasoning
    assert cut.completion_tokens_details.reasoning_tokens == cut.completion_tokens == 3
    off = _create(oai, "q3", extra_body={"chat_template_kwargs": {"enable_thinking": False}}).usage
    assert off.completion_tokens_details.reasoning_tokens == 0
    stream = _create(oai, "r1", stream=True, stream_options={"include_usage": True})
    last = [chunk for chunk in stream][-1]
    assert last.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_responses_api_gives_the_reasoning_its_own_item(oai):
    """The openai SDK's responses.create: a reasoning item (its text whole) before the message,
    streamed as reasoning_text events at output index 0 and the answer at 1; usage counts the
    reasoning tokens; a response cut inside the block is reasoning only, incomplete."""
    r = oai.responses.create(model="r1", input="Hi", max_output_tokens=20, temperature=0)
    assert [item.type for item in r.output] == ["reasoning", "message"], r.output
    assert [c.text for c in r.output[0].content] == ["The user asks"] and r.output_text == ANSWER
    assert r.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS
    events = list(oai.responses.create(model="r1", input="Hi", max_output_tokens=20, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "The user asks"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1]
    assert done.type == "response.completed" and [i.type for i in done.response.output] == ["reasoning", "message"]
    assert done.response.output_text == ANSWER
    assert done.response.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS
    cut = oai.responses.create(model="r1", input="Hi", max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and [item.type for item in cut.output] == ["reasoning", "message"]
    assert cut.output[0].content[0].text == "The user" and cut.output_text == ""
