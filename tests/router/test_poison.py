"""Poison requests over HTTP against the 2-replica `main` app: ids and sizes past the model,
every numeric and list field of the OpenAI and TGI bodies at its type's extremes (hypothesis),
multi-prompt errors. None may answer 5xx, kill or restart an engine replica (same pids after),
move a request to another replica, or leave a KV block held; a normal request answers at once
after them."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

BIG_INTS = [0, 1, -1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63), -(2**64), 10**30]
EXTREME_FLOATS = [0.0, -0.0, 1e-300, -1e-300, 1e308, -1e308, float("inf"), float("-inf"), float("nan")]

# The replica killers and 500s of a hostile client, as they were sent (OpenAI completions).
POISON = [
    {"prompt": "hi", "max_tokens": 4, "top_k": 9223372036854775808, "temperature": 1},
    {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [2**64], "min_tokens": 1},
    {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [49152], "min_tokens": 1},
    {"prompt": "hi", "max_tokens": 4, "stop_token_ids": list(range(5000))},
    {"prompt": "hi", "max_tokens": 4, "stop": ["x" * 200_000] * 16},
    {"prompt": "hi", "max_tokens": 4, "seed": 2**64 + 5, "temperature": 1},
    {"prompt": "hi", "max_tokens": 4, "seed": -(2**70), "temperature": 1},
    {"prompt": "hi", "max_tokens": 4, "logit_bias": {str(2**64): 5}},
    {"prompt": "hi", "max_tokens": 4, "min_tokens": 2**62},
    {"prompt": ["hi", "word " * 5000], "max_tokens": 4},  # the second too long: 400, not 500
    {"prompt": ["hi"] * 5000, "max_tokens": 1},
    {"prompt": [[2**40]], "max_tokens": 4},
    {"prompt": "hi", "max_tokens": 4, "n": 2, "best_of": 2, "seed": 2**63},
    {"prompt": "hi", "max_tokens": 4, "echo": True, "logprobs": 20, "temperature": 1, "top_k": 2**40},
]
TGI_POISON = [
    {"inputs": "hi", "parameters": {"max_new_tokens": 4, "top_k": 2**63, "do_sample": True}},
    {"inputs": "hi", "parameters": {"max_new_tokens": 4, "seed": 2**64 + 1, "do_sample": True}},
    {"inputs": "hi", "parameters": {"max_new_tokens": 4, "stop": ["y" * 100_000]}},
    {"inputs": "hi", "parameters": {"max_new_tokens": 4, "top_n_tokens": 2**40}},
    {"inputs": "hi", "parameters": {"max_new_tokens": 2**63}},
]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    # allow_nan: Python's own json reads NaN and Infinity, so a hostile client can send them.
    data = json.dumps(body, allow_nan=True)
    return httpx.post(url + path, content=data, headers={"Content-Type": "application/json"}, timeout=60)


def _engine_state(handle) -> dict:
    stats = handle.replica_stats.remote().result()
    return {s["replica_id"]: (s["pid"], s["migrated_in"]) for s in stats}


def _pools_whole(handle, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = handle.replica_stats.remote().result()
        if all(s["blocks_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0 for s in stats):
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)


@pytest.fixture(scope="module")
def before(serve_cluster):
    state = _engine_state(serve_cluster["handle"])
    assert len(state) == 2
    return state


def _never_5xx(r: httpx.Response, body) -> None:
    assert r.status_code < 500, (body if len(str(body)) < 500 else str(body)[:500], r.status_code, r.text[:500])


@pytest.mark.parametrize("body", POISON, ids=range(len(POISON)))
def test_openai_poison_never_5xx(base_url, before, body):
    r = _post(base_url, "/v1/completions", body)
    _never_5xx(r, body)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


@pytest.mark.parametrize("body", TGI_POISON, ids=range(len(TGI_POISON)))
def test_tgi_poison_never_5xx(base_url, before, body):
    r = _post(base_url, "/generate", body)
    _never_5xx(r, body)
    if r.status_code >= 400:
        assert r.json()["error"]


NUMERIC = st.one_of(st.sampled_from(BIG_INTS), st.sampled_from(EXTREME_FLOATS))
OPENAI_FIELDS = [
    "max_tokens", "min_tokens", "n", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "best_of", "priority",
]  # fmt: skip
CHAT_FIELDS = ["max_completion_tokens", "top_logprobs", "temperature", "top_k", "seed", "n", "max_tokens"]
LIST_FIELDS = ["stop_token_ids", "stop"]
TGI_FIELDS = [
    "max_new_tokens", "temperature", "top_k", "top_p", "typical_p", "seed", "repetition_penalty",
    "frequency_penalty", "best_of", "top_n_tokens", "truncate",
]  # fmt: skip

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@SETTINGS
@given(fields=st.dictionaries(st.sampled_from(OPENAI_FIELDS), NUMERIC, min_size=1, max_size=3))
def test_openai_numeric_extremes(base_url, before, fields):
    body = {"prompt": "hi", "max_tokens": 2, **fields}
    _never_5xx(_post(base_url, "/v1/completions", body), body)


@SETTINGS
@given(fields=st.dictionaries(st.sampled_from(CHAT_FIELDS), NUMERIC, min_size=1, max_size=3))
def test_chat_numeric_extremes(base_url, before, fields):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    _never_5xx(_post(base_url, "/v1/chat/completions", body), body)


@SETTINGS
@given(
    field=st.sampled_from(LIST_FIELDS),
    items=st.lists(st.one_of(st.sampled_from(BIG_INTS), st.text(min_size=0, max_size=3)), max_size=40),
)
def test_list_field_extremes(base_url, before, field, items):
    body = {"prompt": "hi", "max_tokens": 2, "min_tokens": 1, field: items}
    _never_5xx(_post(base_url, "/v1/completions", body), body)


@SETTINGS
@given(fields=st.dictionaries(st.sampled_from(TGI_FIELDS), NUMERIC, min_size=1, max_size=3))
def test_tgi_numeric_extremes(base_url, before, fields):
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 2, "do_sample": True, **fields}}
    _never_5xx(_post(base_url, "/generate", body), body)


def test_after_the_poison_the_same_replicas_serve_at_once(serve_cluster, base_url, before):
    """Runs after the suites above (file order): no replica died, restarted or handed a request
    to the other, every block is back, and a normal request answers within seconds."""
    handle = serve_cluster["handle"]
    _pools_whole(handle)
    assert _engine_state(handle) == before
    t0 = time.monotonic()
    r = _post(base_url, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    assert time.monotonic() - t0 < 10
