"""Tool calls through the openai SDK: a named function and tool_choice "required" give calls
that parse and match the tools' schemas, streamed and not; a call's result goes back as a
tool message; "auto" finds calls in the model's own syntax (hermes) where the server has that
parser and is a 400 where not; bad tool requests are a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from tests.router.test_errors import _check, post

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 20}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _weather_args(arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")
    return args


def test_named_function(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=60, temperature=0
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = _weather_args(call.function.arguments)
    # Streamed: the same call arrives in the deltas.
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=60, temperature=0, stream=True
    )
    calls, finish = [], None
    for chunk in stream:
        for ch in chunk.choices:
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == args

    # The result goes back as a tool message, and the model answers in text.
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=20, temperature=0
    )
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_required_single_and_parallel(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    if call.function.name == "get_weather":
        _weather_args(call.function.arguments)
    else:
        assert call.function.name == "get_time" and set(json.loads(call.function.arguments)) == {"timezone"}
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=120,
        temperature=0.7,
        seed=3,
    )
    c = r.choices[0]
    if c.finish_reason == "tool_calls":  # else max_tokens cut the list: it stays text
        assert len(c.message.tool_calls) >= 1
        assert all(t.function.name in ("get_weather", "get_time") for t in c.message.tool_calls)
    else:
        assert c.finish_reason == "length" and c.message.content.startswith("[")


FORCED = (
    r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "celsius"\}\}'
    r"\n</tool_call>"
)


def test_auto_with_the_hermes_parser(client):
    """tool_choice "auto" (the default) on a server with tool_call_parser hermes: calls in the
    model's own <tool_call> blocks are told from text. A grammar makes this small model write one."""
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0)
    r = client.chat.completions.create(**kw, extra_body={"structured_outputs": {"regex": FORCED}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and _weather_args(call.function.arguments)["city"] == "Paris"
    stream = client.chat.completions.create(**kw, stream=True, extra_body={"structured_outputs": {"regex": FORCED}})
    content, calls, finish = "", [], None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert content.strip() == "Let me check." and finish == "tool_calls"
    assert [t.function.arguments for t in calls] == [call.function.arguments]
    # Plain text stays text, streamed whole.
    r = client.chat.completions.create(**kw, extra_body={"structured_outputs": {"regex": "It is sunny <3"}})
    assert r.choices[0].message.content == "It is sunny <3" and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_auto_without_a_parser_is_a_400(serve_cluster):
    """The strict app has no tool_call_parser: "auto", explicit or the default with tools, is refused."""
    url, key = serve_cluster["strict_url"], serve_cluster["strict_key"]
    for extra in ({}, {"tool_choice": "auto"}):
        r = post(
            url,
            "/v1/chat/completions",
            json={"messages": ASK, "max_tokens": 4, "tools": [WEATHER], **extra},
            headers={"Authorization": f"Bearer {key}"},
        )
        err = _check(r, 400, "tool_choice")
        assert "required" in err["message"] and "tool_call_parser" in err["message"]


def test_bad_tool_requests_are_a_400(base_url):
    chat = {"messages": ASK, "max_tokens": 4}
    named = {"type": "function", "function": {"name": "nope"}}
    cases = [
        ({**chat, "tools": [WEATHER], "tool_choice": named}, "tool_choice"),
        ({**chat, "tool_choice": "required"}, "tool_choice"),
        ({**chat, "tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
        (
            {**chat, "tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {
                **chat,
                "tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": 7}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({**chat, "tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "none"}, "tools"),
    ]
    for body, param in cases:
        err = _check(post(base_url, "/v1/chat/completions", json=body), 400)
        assert param in (err["param"] or "") or param in err["message"], (body, err)
