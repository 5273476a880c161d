"""The tool-call parsers (tool_choice "auto"), hermes and llama3_json: calls and content of whole
outputs, and a stream's content deltas never showing any of a call's text."""

from __future__ import annotations

import json

from router.ingress.tool_parsers import ContentStream, parse, parse_hermes, parse_llama3_json

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_parse_hermes():
    assert parse_hermes("just text") == ("just text", [])
    content, calls = parse_hermes("Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Rome"))
    assert content == "Let me check." and [n for n, _ in calls] == ["get_weather"] * 2
    assert [json.loads(a)["city"] for _, a in calls] == ["Paris", "Rome"]
    assert parse_hermes(CALL) == (None, [("get_weather", '{"city": "Paris"}')])
    # Not whole calls: the output stays text.
    for text in (
        "x " + CALL[:-5],  # unclosed: cut by max_tokens
        "x <tool_call>{not json}</tool_call>",
        'x <tool_call>{"arguments": {}}</tool_call>',  # no name
        'x <tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        "x " + CALL + "<tool_call>",
    ):
        assert parse_hermes(text) == (text, [])


def test_content_stream_holds_back_what_may_start_a_call():
    text = "Sure! Let me look <tool_ that up.\n" + CALL
    stream, sent = ContentStream(), ""
    for i in range(1, len(text) + 1):  # one character at a time
        sent += stream.delta(text[:i])
        assert text.startswith(sent) and len(sent) <= text.index("<tool_call>")  # never a call's own text
    assert sent == text[: text.index("<tool_call>")] and stream.rest(text, has_calls=True) == ""
    # No call after all: everything held back goes out at the end.
    plain = "a < b <tool"
    stream, sent = ContentStream(), ""
    for i in range(1, len(plain) + 1):
        sent += stream.delta(plain[:i])
    assert sent == "a < b " and sent + stream.rest(plain, has_calls=False) == plain


def test_parse_llama3_json():
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse_llama3_json(one) == (None, [("get_weather", '{"city": "Paris"}')])
    two = f"<|python_tag|>{one}; {one.replace('Paris', 'Rome')}"
    assert [json.loads(a)["city"] for _, a in parse_llama3_json(two)[1]] == ["Paris", "Rome"]
    for text in ("The weather is fine.", one[:-3], one + " and more text", '{"city": "Paris"}', '{"name": 3}'):
        assert parse_llama3_json(text) == (text, [])
    assert parse("llama3_json", one) == parse_llama3_json(one) and parse("hermes", CALL)[1]


def test_llama3_stream_decides_by_the_first_characters():
    call = '  {"name": "f", "parameters": {}}'
    for text, content in ((call, ""), ("<|python_tag|>" + call, ""), ("It is sunny {really}", "It is sunny {really}")):
        stream, sent = ContentStream("llama3_json"), ""
        for i in range(1, len(text) + 1):
            sent += stream.delta(text[:i])
        has_calls = bool(parse_llama3_json(text)[1])
        assert sent + stream.rest(text, has_calls) == content
