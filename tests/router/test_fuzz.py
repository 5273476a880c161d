"""Hostile input never gets a 5xx, never hangs, and never disturbs other requests:
schemathesis (the command-line tool, unchanged) against the app's own OpenAPI schema, and a
hand-written list of hostile bodies, while a long stream runs beside them.

The fuzzed app serves the chat stand-in (tests/tiny_llama.py: the embedded model's tokenizer and
chat template on a 2-layer random Llama) with a 32-token context, so every generated request
stays cheap on CPU (TGI's default of 100 new tokens is cut to what the context has left)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.net import wait_healthy
from tests.router.conftest import BASE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fuzz_url(serve_cluster, chat_stand_in):
    from ray import serve

    from router.app import build_app
    from router.config import AppConfig

    cfg = AppConfig(**BASE, model=chat_stand_in, max_model_len=32)
    serve.run(build_app(cfg), name="fuzz", route_prefix="/fuzz")
    url = f"{serve_cluster['url']}/fuzz"
    wait_healthy(url)
    yield url
    serve.delete("fuzz")


@pytest.fixture(scope="module")
def bystander(fuzz_url):
    """A streamed request that runs while the fuzzing goes on; it must end normally."""
    result: dict = {}

    def run() -> None:
        text = ""
        body = {"prompt": "Once", "max_tokens": 28, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{fuzz_url}/v1/completions", json=body, timeout=600) as s:
            for line in s.iter_lines():
                text += line
        result["ok"] = s.status_code == 200 and "[DONE]" in text and '"finish_reason":"length"' in text

    t = threading.Thread(target=run)
    t.start()
    result["thread"] = t
    yield result
    t.join(timeout=600)


HOSTILE = [
    {"prompt": "hi", "max_tokens": 10**30},
    {"prompt": "hi", "max_tokens": -(10**30)},
    {"prompt": "hi", "max_tokens": 2**63},
    {"prompt": "hi", "n": 10**9},
    {"prompt": "hi", "n": -1},
    {"prompt": "hi", "logprobs": 10**6},
    {"prompt": "hi", "logprobs": -3},
    {"prompt": "hi", "temperature": 1e308, "top_p": 1e-308},
    {"prompt": "hi", "seed": 2**70},
    {"prompt": "hi", "stop": ["x"] * 10_000},
    {"prompt": "hi", "stop_token_ids": [-1, 10**12]},
    {"prompt": ""},
    {"prompt": "a" * (1 << 20)},
    {"prompt": [[]]},
    {"prompt": [[-5]]},
    {"prompt": {"nested": [1, {"x": None}]}},
    {"prompt": "hi", "priority": 10**40},
    {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "maybe"}},
]
HOSTILE_RAW = [
    b"\xff\xfe\xfa not utf-8",
    b'{"prompt": "\xc3\x28"}',
    b"[" * 200_000,
    b'{"prompt": "hi", "max_tokens": 1e999}',
    b'{"prompt": "hi", "temperature": NaN}',
    b"null",
    b"",
]


def test_hostile_bodies_never_5xx(fuzz_url, bystander):
    with httpx.Client(timeout=120) as c:
        for body in HOSTILE:
            rest = {k: v for k, v in body.items() if k != "prompt"}
            for path, sent in (
                ("/v1/completions", body),
                ("/v1/chat/completions", {**rest, "messages": [{"role": "user", "content": body.get("prompt")}]}),
                ("/v1/responses", {**rest, "input": body.get("prompt")}),
                ("/v1/embeddings", {**rest, "input": body.get("prompt")}),
            ):
                r = c.post(f"{fuzz_url}{path}", json=sent)
                assert r.status_code < 500, (path, str(sent)[:200], r.status_code, r.text[:300])
        for raw in HOSTILE_RAW:
            for path in (
                "/v1/completions",
                "/v1/chat/completions",
                "/v1/responses",
                "/v1/embeddings",
                "/generate",
                "/generate_stream",
                "/",
            ):
                r = c.post(f"{fuzz_url}{path}", content=raw, headers={"content-type": "application/json"})
                assert 400 <= r.status_code < 500, (path, raw[:60], r.status_code, r.text[:300])


def test_schemathesis_finds_no_server_error(fuzz_url, bystander):
    st = Path(sys.executable).with_name("st")
    r = subprocess.run(
        [
            str(st),
            "run",
            f"{fuzz_url}/openapi.json",
            "--url",
            fuzz_url,
            "--checks",
            # Every answer (2xx and error) matches the schema the app publishes.
            "not_a_server_error,response_schema_conformance",
            # Generated bodies from the schema (both valid and invalid ones); boundary values
            # are the hand-written list's job above. Now that the schema's bounds are the
            # server's, most bodies are accepted and generate: 12 per route, about 45 s here.
            "--phases",
            "fuzzing",
            "--max-examples",
            "12",
            "--request-timeout",
            "120",
            "--generation-deterministic",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    print(r.stdout[-1500:])
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def test_bystander_stream_finished(bystander, fuzz_url):
    """Runs last in this module: the stream that ran beside the fuzzing ended normally."""
    bystander["thread"].join(timeout=300)
    assert bystander.get("ok"), bystander
    wait_healthy(fuzz_url)
