"""OpenAI's Responses API (`/v1/responses`, router/ingress/responses_api.py) through the openai
SDK against an app of the chat stand-in (no tool-call parser): its answers equal chat
completions' for the same messages, streamed events come in a valid order and make the same
text, stored responses continue a conversation (and store=false ones do not), text.format and
function tools act, and every field it does not do is a 400 naming it."""

from __future__ import annotations

import json

import httpx
import pytest

from router.ingress.response_models import SSE, SUCCESS
from router.ingress.responses_models import ResponseObject
from tests.router.conftest import BASE
from tests.serve_cluster import serve_app

pytestmark = pytest.mark.slow
MODEL = "stand-in"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
CHOICE = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def app(chat_stand_in):
    with serve_app("responses", "/responses", **BASE, model=chat_stand_in, served_model_name=MODEL) as a:
        yield a


@pytest.fixture(scope="module")
def oa(app):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{app['url']}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(oa, messages: list[dict], **kw):
    return oa.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def _raw(app, body: dict) -> dict:
    """The JSON body as the server sent it, checked against the schema /openapi.json publishes."""
    r = httpx.post(f"{app['url']}/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    ResponseObject.model_validate(r.json())
    return r.json()


def test_create_equals_chat_completions(oa, app):
    r = oa.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input="Name a colour.",
        max_output_tokens=12,
        temperature=0,
        metadata={"k": "v"},
        user="tester",
    )
    chat = _chat(
        oa,
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}],
        max_completion_tokens=12,
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.metadata == {"k": "v"} and r.user == "tester" and r.instructions == "Answer briefly."
    # The same input as message items with input_text parts: the same prompt and answer.
    items = [
        {"role": "developer", "content": "Answer briefly."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
    ]
    again = _raw(app, {"model": MODEL, "input": items, "max_output_tokens": 12, "temperature": 0})
    chat_dev = _chat(
        oa,
        [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}],
        max_completion_tokens=12,
    )
    assert again["output"][0]["content"][0]["text"] == chat_dev.choices[0].message.content
    # temperature reaches the sampler: greedy is one answer, temperature 2 another.
    hot = oa.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=12, temperature=2.0, top_p=1.0)
    cold = oa.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=12, temperature=0)
    assert hot.output_text != cold.output_text


def test_max_output_tokens_is_honoured(oa):
    r = oa.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert r.usage.output_tokens <= 3
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 3
    longer = oa.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=9, temperature=0)
    assert longer.usage.output_tokens > r.usage.output_tokens or longer.status == "completed"
    assert longer.output_text.startswith(r.output_text)


def test_stream_events(oa, app):
    kw = dict(model=MODEL, input="Name a colour.", max_output_tokens=12, temperature=0)
    plain = oa.responses.create(**kw)
    events = list(oa.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    n = kinds.count("response.output_text.delta")
    assert n >= 1 and kinds[4 : 4 + n] == ["response.output_text.delta"] * n
    end = "response.incomplete" if plain.status == "incomplete" else "response.completed"
    assert kinds[4 + n :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        end,
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text
    assert events[4 + n].text == text and events[-1].response.usage.output_tokens == plain.usage.output_tokens
    # The wire: `event:` names each event's type, every `data:` fits the published schema, no [DONE].
    model = SUCCESS[("/v1/responses", "post")][SSE]
    with httpx.stream("POST", f"{app['url']}/v1/responses", json={**kw, "stream": True}, timeout=120) as s:
        lines = [line for line in s.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    # (how the text splits into deltas depends on timing)
    assert names == [d["type"] for d in datas] and names[-1] == kinds[-1]
    assert "".join(d["delta"] for d in datas if d["type"] == "response.output_text.delta") == text
    for d in datas:
        model.model_validate(d)


def test_previous_response_id_continues_the_conversation(oa, app):
    first = oa.responses.create(
        model=MODEL, instructions="Be brief.", input="Name a colour.", max_output_tokens=8, temperature=0
    )
    second = oa.responses.create(
        model=MODEL, previous_response_id=first.id, input="And another?", max_output_tokens=8, temperature=0
    )
    # The instructions are not carried over; the first exchange is.
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another?"},
    ]
    chat = _chat(oa, messages, max_completion_tokens=8)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens
    assert second.output_text == chat.choices[0].message.content
    # Streamed, continuing the same response: the same answer.
    events = list(
        oa.responses.create(
            model=MODEL,
            previous_response_id=first.id,
            input="And another?",
            max_output_tokens=8,
            temperature=0,
            stream=True,
        )
    )
    assert events[-1].response.output_text == second.output_text
    # Stored responses can be read back and deleted.
    got = oa.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    oa.responses.delete(first.id)
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.create(model=MODEL, previous_response_id=first.id, input="x", max_output_tokens=2)


def test_store_false_is_not_kept(oa, app):
    r = oa.responses.create(model=MODEL, input="Hi.", max_output_tokens=2, store=False)
    assert r.store is False
    body = {"model": MODEL, "input": "x", "previous_response_id": r.id, "max_output_tokens": 2}
    resp = httpx.post(f"{app['url']}/v1/responses", json=body, timeout=120)
    assert resp.status_code == 404, resp.text
    err = resp.json()["error"]
    assert err["param"] == "previous_response_id" and err["type"] == "not_found_error" and r.id in err["message"]
    assert httpx.get(f"{app['url']}/v1/responses/{r.id}", timeout=30).status_code == 404
    assert httpx.delete(f"{app['url']}/v1/responses/resp_unknown", timeout=30).status_code == 404
    refused = httpx.get(f"{app['url']}/v1/responses/{r.id}?stream=true", timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"


def test_text_format_json_schema(oa):
    fmt = {"type": "json_schema", "name": "pick", "schema": CHOICE, "strict": True}
    r = oa.responses.create(model=MODEL, input="Pick one.", max_output_tokens=40, temperature=0, text={"format": fmt})
    obj = json.loads(r.output_text)
    assert set(obj) == {"color", "ok"} and obj["color"] in ("red", "blue") and isinstance(obj["ok"], bool)
    plain = oa.responses.create(
        model=MODEL, input="Pick one.", max_output_tokens=40, temperature=0, text={"format": {"type": "text"}}
    )
    assert plain.output_text != r.output_text and r.text.format.type == "json_schema"
    obj = oa.responses.create(
        model=MODEL, input="Pick one.", max_output_tokens=40, temperature=0, text={"format": {"type": "json_object"}}
    )
    assert obj.output_text.startswith("{")


def test_function_tool_round_trip(oa, app):
    choice = {"type": "function", "name": "get_weather"}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = oa.responses.create(
        model=MODEL, input=ask, tools=[WEATHER], tool_choice=choice, max_output_tokens=40, temperature=0
    )
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    args = json.loads(call.arguments)
    assert args["city"] in ("Paris", "Rome") and args["unit"] in ("celsius", "fahrenheit")
    # Streamed: the call's events, and the same arguments.
    events = list(
        oa.responses.create(
            model=MODEL,
            input=ask,
            tools=[WEATHER],
            tool_choice=choice,
            max_output_tokens=40,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ], kinds
    assert events[2].item.type == "function_call" and json.loads(events[4].arguments) == args
    # The result goes back as function_call_output: the prompt is chat's with a tool message.
    follow = [
        *ask,
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'},
    ]
    answer = oa.responses.create(
        model=MODEL, input=follow, tools=[WEATHER], tool_choice="none", max_output_tokens=8, temperature=0
    )
    history = [
        *ask,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature": 21}'},
    ]
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    chat = _chat(oa, history, tools=tools, tool_choice="none", max_completion_tokens=8)
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    # Continuing a response whose output is a call: its call comes before the output.
    cont = oa.responses.create(
        model=MODEL,
        previous_response_id=r.id,
        input=[follow[-1]],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=8,
    )
    assert cont.usage.input_tokens == answer.usage.input_tokens


def test_top_p_reaches_the_sampler(oa):
    kw = dict(model=MODEL, input="Name a colour.", max_output_tokens=12, temperature=2.0)
    # A tiny top_p leaves only the likeliest token: greedy's answer, whatever the temperature.
    narrow = oa.responses.create(top_p=1e-6, **kw)
    greedy = oa.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=12, temperature=0)
    assert narrow.output_text == greedy.output_text and narrow.top_p == 1e-6


def test_required_calls_and_parallel_tool_calls(oa):
    time_tool = {**WEATHER, "name": "get_time", "description": "The time in a city."}
    kw = dict(
        model=MODEL, input="Weather and time in Paris?", tools=[WEATHER, time_tool], max_output_tokens=80, temperature=0
    )
    one = oa.responses.create(tool_choice="required", parallel_tool_calls=False, **kw)
    assert len(one.output) == 1 and one.output[0].type == "function_call" and not one.parallel_tool_calls
    assert one.output[0].name in ("get_weather", "get_time") and isinstance(json.loads(one.output[0].arguments), dict)
    # With parallel calls the grammar lets the list go on (this model's may run to the cap).
    many = oa.responses.create(tool_choice="required", **kw)
    assert many.status == "incomplete" or all(o.type == "function_call" for o in many.output)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.0.type"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
        ({"tools": [WEATHER]}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_tool_calls": 1}, "max_tool_calls"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"prompt_cache_key": "k"}, "prompt_cache_key"),
        ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
        ({"safety_identifier": "u"}, "safety_identifier"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "other"}, "model"),
    ],
)
def test_unsupported_fields_are_400s_naming_them(app, extra, param):
    body = {"model": MODEL, "input": "Hi.", "max_output_tokens": 2, **extra}
    r = httpx.post(f"{app['url']}/v1/responses", json=body, timeout=120)
    want = 404 if param == "model" else 400
    assert r.status_code == want, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(param), err
