"""Several models behind one endpoint, end to end (real Ray + Serve + HTTP): the embedded
SmolLM2 as pool `smol` (tiny queues: 1 running, 1 queued) and a tiny random Llama saved here as
pool `tiny`, plus the alias `tier` = [smol, tiny].

Each pool answers under its name with the greedy output of that model served alone (the offline
engine); an unknown name is OpenAI's 404; /v1/models, /health and /metrics cover both pools; a
request for the alias moves to `tiny` only when `smol` sheds load (429)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from engine import SamplingParams
from tests.engine.test_tiny_models import _save_tiny
from tests.net import wait_healthy
from tests.router.conftest import BASE

pytestmark = pytest.mark.slow
SMOL, TINY, ALIAS = "smol", "tiny", "tier"
PROMPT = "The capital of France is"
MAX_TOKENS = 8
LONG_PROMPT_TOKENS = 40


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm_tokenizer):
    path = tmp_path_factory.mktemp("tiny-llama")
    _save_tiny("llama3", path, smollm_tokenizer)  # the tiny random Llama of the engine tests
    return str(path)


@pytest.fixture(scope="module")
def multi(serve_cluster, tiny_dir):
    from ray import serve

    from router.app import build_app
    from router.config import AppConfig

    cfg = AppConfig(
        **BASE,
        models=[
            {"name": SMOL, "max_num_seqs": 1, "max_queued_requests_per_replica": 1},
            {"name": TINY, "model": tiny_dir},
        ],
        aliases={ALIAS: [SMOL, TINY]},
        # A long prompt starts at the second pool (PROMPT is 5 tokens).
        tier_routing={ALIAS: {"rules": [{"pool": TINY, "min_prompt_tokens": LONG_PROMPT_TOKENS}]}},
    )
    handle = serve.run(build_app(cfg), name="multi", route_prefix="/multi")
    url = f"{serve_cluster['url']}/multi"
    wait_healthy(url)
    yield {"url": url, "handle": handle}
    serve.delete("multi")


@pytest.fixture(scope="module")
def url(multi) -> str:
    return multi["url"]


@pytest.fixture(scope="module")
def client(url):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(offline_llm, tiny_dir) -> dict[str, str]:
    """Each model's greedy text for PROMPT, served alone (the offline engine, no Ray)."""
    from engine import LLM

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tiny = LLM(tiny_dir, dtype="float32", kv_cache_memory_bytes=64 << 20, num_threads=1)
    try:
        tiny_text = tiny.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    finally:
        tiny.shutdown()
    want = {SMOL: offline_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text, TINY: tiny_text}
    assert want[SMOL] != want[TINY]  # the text says which model answered
    return want


def _complete(url: str, model: str | None, **extra) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics parsed by prometheus_client: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _finished(samples: dict, model: str) -> float:
    return sum(
        v
        for (name, labels), v in samples.items()
        if name == "orbital:request_success_total" and ("model_name", model) in labels
    )


def _overflows(samples: dict) -> float:
    labels = (("alias", ALIAS), ("cause", "overload"), ("from_pool", SMOL), ("to_pool", TINY))
    key = ("orbital:tier_overflows_total", labels)
    return samples[key]


def test_each_model_answers_under_its_name(client, expected):
    for model in (SMOL, TINY):
        r = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.model == model
        assert r.choices[0].text == expected[model], model
        assert r.usage.completion_tokens == MAX_TOKENS
    # Chat goes by `model` too (the tiny model carries SmolLM2's chat template).
    chat = client.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == TINY and chat.usage.completion_tokens >= 1


def test_no_model_means_the_first_pool_and_tgi_too(url, expected):
    for model in (None, ""):
        r = _complete(url, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == SMOL and r.json()["choices"][0]["text"] == expected[SMOL]
    assert httpx.get(f"{url}/info", timeout=30).json()["model_id"] == SMOL
    g = httpx.post(
        f"{url}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": MAX_TOKENS}}, timeout=120
    )
    assert g.status_code == 200, g.text
    # TGI is greedy by default; smol's greedy text (an EOS could only end it earlier).
    assert expected[SMOL].startswith(g.json()["generated_text"])


def test_unknown_model_is_openais_404(url):
    r = _complete(url, "no-such-model")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "no-such-model" in err["message"]
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "gpt-4", "messages": [{"role": "user", "content": "Hi"}]},
        timeout=60,
    )
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"


def test_models_lists_pools_and_aliases(client):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [SMOL, TINY, ALIAS]
    assert cards[ALIAS].max_model_len == cards[SMOL].max_model_len  # the tier's first pool's
    assert cards[TINY].max_model_len == 512 != cards[SMOL].max_model_len  # each model's own context


def test_health_reports_every_pool(url):
    h = httpx.get(f"{url}/health", timeout=60)
    assert h.status_code == 200
    body = h.json()
    assert body["status"] == "ok" and body["replicas"] == body["expected_replicas"] == 2
    assert set(body["pools"]) == {SMOL, TINY}
    assert all(p["status"] == "ok" and p["replicas"] == 1 for p in body["pools"].values())


def test_metrics_are_labelled_by_model(url, multi):
    before = _samples(url)
    assert _complete(url, TINY).status_code == 200
    after = _samples(url)
    gen = {
        model: after[("orbital:generation_tokens_total", (("model_name", model),))]
        - before[("orbital:generation_tokens_total", (("model_name", model),))]
        for model in (SMOL, TINY)
    }
    assert gen == {SMOL: 0, TINY: MAX_TOKENS}
    assert after[("orbital:num_replicas", (("model_name", SMOL),))] == 1
    assert after[("orbital:num_replicas", (("model_name", TINY),))] == 1
    names = {name for name, _ in after}
    assert "orbital:tier_overflows_total" in names
    # The Python handle API reaches each pool's counts.
    counts = multi["handle"].routed_counts.remote(pool=TINY).result()
    assert sum(counts.values()) >= 1


def test_alias_stays_on_its_first_pool_when_it_has_room(url, expected):
    before = _samples(url)
    for _ in range(3):  # one at a time: smol always has room
        r = _complete(url, ALIAS)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == ALIAS and r.json()["choices"][0]["text"] == expected[SMOL]
    stream = httpx.post(
        f"{url}/v1/completions",
        json={"model": ALIAS, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True},
        timeout=120,
    )
    assert stream.status_code == 200 and '"model":"tier"' in stream.text and "[DONE]" in stream.text
    after = _samples(url)
    assert _overflows(after) == _overflows(before)
    assert _finished(after, SMOL) - _finished(before, SMOL) == 4
    assert _finished(after, TINY) == _finished(before, TINY)


def test_alias_overflows_to_the_next_pool_only_under_load(url):
    """A burst: smol takes 1 running + 1 queued and sheds the rest, which tiny serves; no
    request fails. Asking for smol itself in a burst gets the 429s (no overflow)."""
    n = 8
    before = _samples(url)

    async def burst(model: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as c:
            bodies = [
                {
                    "model": model,
                    "prompt": PROMPT,
                    "max_tokens": 24,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": i % 2 == 1,  # streams overflow before their first chunk too
                }
                for i in range(n)
            ]
            return await asyncio.gather(*(c.post(f"{url}/v1/completions", json=b) for b in bodies))

    responses = asyncio.run(burst(ALIAS))
    assert [r.status_code for r in responses] == [200] * n, [r.text[:200] for r in responses]
    for r in responses:
        assert '"model":"tier"' in r.text.replace(" ", "") and '"error"' not in r.text
    after = _samples(url)
    moved = _overflows(after) - _overflows(before)
    on_smol = _finished(after, SMOL) - _finished(before, SMOL)
    on_tiny = _finished(after, TINY) - _finished(before, TINY)
    assert moved >= 1 and on_tiny == moved and on_smol + on_tiny == n, (moved, on_smol, on_tiny)

    # The pool by its own name sheds load with 429 instead.
    direct = asyncio.run(burst(SMOL))
    codes = sorted(r.status_code for r in direct)
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes, codes
    shed = next(r for r in direct if r.status_code == 429)
    assert shed.json()["error"]["code"] == "rate_limit_exceeded" and "retry-after" in shed.headers
    assert _overflows(_samples(url)) == _overflows(after)


def _decisions(samples: dict) -> dict[tuple[str, str], float]:
    return {
        (dict(labels)["pool"], dict(labels)["reason"]): v
        for (name, labels), v in samples.items()
        if name == "orbital:tier_decisions_total" and dict(labels)["alias"] == ALIAS
    }


def test_the_tier_policy_picks_the_starting_pool_by_rule_and_hint(url):
    """The app's rule sends a long prompt to the second pool; the hint header names a pool; a
    hint that names none is a 400 naming the header. /metrics counts each decision."""
    before = _samples(url)
    long_prompt = "Count the ships that sailed past the lighthouse tonight. " * 6
    routed = [
        _complete(url, ALIAS, prompt=long_prompt),  # the rule
        httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": ALIAS, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            headers={"x-orbital-tier": TINY},
            timeout=120,
        ),
        _complete(url, ALIAS),  # short: the first pool by default
    ]
    assert [r.status_code for r in routed] == [200] * 3, [r.text for r in routed]
    assert all(r.json()["model"] == ALIAS for r in routed)
    after = _samples(url)
    assert _finished(after, TINY) - _finished(before, TINY) == 2
    assert _finished(after, SMOL) - _finished(before, SMOL) == 1
    picked = {k: after_v - _decisions(before).get(k, 0) for k, after_v in _decisions(after).items()}
    assert {k: v for k, v in picked.items() if v} == {(TINY, "rule"): 1, (TINY, "hint"): 1, (SMOL, "default"): 1}
    bad = httpx.post(
        f"{url}/v1/completions",
        json={"model": ALIAS, "prompt": "x", "max_tokens": 2},
        headers={"x-orbital-tier": "huge"},
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-orbital-tier", bad.text
