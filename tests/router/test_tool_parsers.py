"""The hermes tool-call parser (tool_choice "auto"): calls and content of whole outputs, and a
stream's content deltas never showing any of a call's text."""

from __future__ import annotations

import json

from router.ingress.tool_parsers import ContentStream, parse_hermes

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
