"""The official openai SDK against the router: completions and chat, streamed and not, n=2,
logprobs, stop, seed, echo, usage; greedy output equal to the offline engine's."""

from __future__ import annotations

import pytest

from engine import SamplingParams

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]


def test_completion_greedy_equals_offline(client, offline_llm):
    want = offline_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == want.outputs[0].text
    assert r.choices[0].finish_reason == want.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert len([c for c in chunks if c.choices]) > 3  # really incremental


def test_chat_greedy_equals_offline(client, offline_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = offline_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    # max_completion_tokens is the same limit
    r2 = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24, temperature=0)
    assert r2.choices[0].message.content == r.choices[0].message.content


def test_chat_stream(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n2_and_seed(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=2, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.usage.completion_tokens == 24
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, n=2, seed=7, temperature=1.0
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_n2_stream(client):
    chunks = list(
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, n=2, seed=3, temperature=1.0, stream=True)
    )
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1}
    full = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, n=2, seed=3, temperature=1.0)
    assert [texts[0], texts[1]] == [c.text for c in sorted(full.choices, key=lambda c: c.index)]


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == pytest.approx(v) and max(top.values()) == pytest.approx(v)  # greedy = top-1
    c = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == c.choices[0].message.content


def test_echo_with_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    assert r.choices[0].text.startswith(PROMPT)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == r.usage.prompt_tokens + 3


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    assert "." in base
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=["."])
    assert r.choices[0].text == base[: base.index(".")]
    assert r.choices[0].finish_reason == "stop"
    s = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=".", stream=True))
    assert "".join(c.choices[0].text for c in s if c.choices) == r.choices[0].text


def test_prompt_list_and_token_ids(client, offline_llm):
    tok = offline_llm.tokenizer
    ids = tok(PROMPT).input_ids
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == sorted(r.choices, key=lambda c: c.index)[0].text
    two = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=4, temperature=0)
    assert len(two.choices) == 2 and two.usage.prompt_tokens == 2 * len(ids)
