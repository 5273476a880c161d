"""Structured outputs and logit_bias over HTTP, as clients send them: the openai SDK's
`response_format` (json_schema, json_object) and the `structured_outputs` extension (regex,
choice, grammar), streamed and not; huggingface_hub's TGI `grammar`; bad specs are a 400 in
each API's error shape naming the field."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.router.test_errors import _check, post

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"


def _person(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and isinstance(obj["age"], int), text


def test_chat_json_schema_and_json_object(client):
    messages = [{"role": "user", "content": "Describe a person."}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    assert r.choices[0].finish_reason == "stop"
    _person(r.choices[0].message.content)
    # Streamed: the deltas make the same text.
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=60,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, response_format={"type": "json_object"}
    )
    c = r.choices[0]
    assert c.message.content.startswith("{")
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)


def test_completions_regex_choice_grammar_extension(client):
    r = client.completions.create(
        model=MODEL,
        prompt="Call me at",
        max_tokens=20,
        temperature=1.0,
        seed=5,
        n=2,
        extra_body={"structured_outputs": {"regex": PHONE}},
    )
    assert len(r.choices) == 2 and all(re.fullmatch(PHONE, c.text) for c in r.choices), r.choices
    # structured_outputs, and vLLM's older spelling that many clients still send
    for extra in ({"structured_outputs": {"choice": [" yes", " no"]}}, {"guided_choice": [" yes", " no"]}):
        r = client.completions.create(
            model=MODEL, prompt="Is water wet? Answer:", max_tokens=5, temperature=0, extra_body=extra
        )
        assert r.choices[0].text in (" yes", " no")
    stream = client.completions.create(
        model=MODEL,
        prompt="Six times seven is",
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"structured_outputs": {"grammar": 'root ::= " " [1-9] [0-9]?'}},
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert re.fullmatch(r" [1-9][0-9]?", text), text


def test_logit_bias(client):
    tok = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0)
    forced = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=3,
        temperature=0,
        logit_bias={"28": 100},
        logprobs=0,
    )
    assert forced.choices[0].logprobs.tokens == [forced.choices[0].logprobs.tokens[0]] * 3
    assert forced.choices[0].text != tok.choices[0].text


def test_tgi_grammar(base_url):
    hub = pytest.importorskip("huggingface_hub")
    hf = hub.InferenceClient(base_url=base_url, timeout=120)
    text = hf.text_generation("A person:", max_new_tokens=60, grammar={"type": "json", "value": PERSON})
    _person(text)
    text = hf.text_generation("Call me at", max_new_tokens=20, grammar={"type": "regex", "value": PHONE})
    assert re.fullmatch(PHONE, text), text


def test_bad_specs_are_a_400_naming_the_field(base_url):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema"}}, "response_format"),
        (
            "/v1/chat/completions",
            {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
            "response_format",
        ),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        (
            "/v1/completions",
            {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
        ),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {}}, "structured_outputs"),
        ("/v1/completions", {"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, "structured_outputs"),
        (
            "/v1/completions",
            {"prompt": "hi", "guided_regex": "a(", "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {"grammar": "start: nope"}}, "structured_outputs"),
        # Valid, but its masks would cost every step ~0.4 s: refused by the engine replica.
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "x{300000}"}}, "structured_outputs"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1000}}, "logit_bias"),
        (
            "/v1/completions",
            {"prompt": "hi", "min_tokens": 2, "response_format": {"type": "json_object"}},
            "min_tokens",
        ),
    ]
    for path, body, param in cases:
        err = _check(post(base_url, path, json=body), 400)
        assert param in (err["param"] or "") or param in err["message"], (body, err)
    r = post(base_url, "/generate", json={"inputs": "hi", "parameters": {"grammar": {"type": "regex", "value": "a(b"}}})
    assert r.status_code == 422 and "grammar" in r.json()["error"], r.text
    # The server still serves constrained requests after all that.
    r = httpx.post(
        f"{base_url}/v1/completions",
        json={"prompt": "Call me at", "max_tokens": 20, "structured_outputs": {"regex": PHONE}},
        timeout=120,
    )
    assert r.status_code == 200 and re.fullmatch(PHONE, r.json()["choices"][0]["text"])
