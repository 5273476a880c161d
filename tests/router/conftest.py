"""Two applications on the run's shared Ray cluster (tests/serve_cluster.py) for all of
tests/router (deploying the model costs ~30-60 s here):

  * `main` at /        : 2 engine replicas, defaults (no API key), float32, small KV budget,
                         the hermes tool-call parser;
  * `strict` at /strict: 1 replica, API key, no tool-call parser, tiny queues (max 2 running, 1 queued per replica,
    2 queued in the router), 64 KiB body limit, 8 s request timeout.
Both are deleted at the end; the modules' own apps are deleted by their fixtures.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.serve_cluster import run_app, shared_serve

STRICT_KEY = "test-key"


BASE = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, num_threads=1, cpus_per_worker=1.0)


@pytest.fixture(scope="package")
def serve_cluster(tmp_path_factory):
    pytest.importorskip("ray")
    from ray import serve

    from router.config import AppConfig

    url = shared_serve()
    main_cfg = AppConfig(**BASE, num_replicas=2, tool_call_parser="hermes")
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(STRICT_KEY + "\n")
    strict_cfg = AppConfig(
        **BASE,
        num_replicas=1,
        api_key_file=str(key_file),  # read by the ingress replica
        max_num_seqs=2,
        max_queued_requests_per_replica=1,
        max_queued_requests=2,
        max_request_body_bytes=64 << 10,
        request_timeout_s=8.0,
    )
    try:
        handle = run_app(main_cfg, "main", url)
        strict = run_app(strict_cfg, "strict", url, route_prefix="/strict")
        yield {
            "url": url,
            "strict_url": f"{url}/strict",
            "handle": handle,
            "strict_handle": strict,
            "main_cfg": main_cfg,
            "strict_cfg": strict_cfg,
            "strict_key": STRICT_KEY,
        }
    finally:
        serve.delete("main")
        serve.delete("strict")


@pytest.fixture(scope="package")
def base_url(serve_cluster) -> str:
    return serve_cluster["url"]


@pytest.fixture(scope="package")
def client(base_url):
    """The official openai SDK pointed at the `main` app."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def offline_llm():
    """The offline engine with the same settings, for greedy-equality checks."""
    from engine import LLM

    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 << 20, num_threads=1)
    yield llm
    llm.shutdown()


def metrics(url: str, headers=None) -> dict[str, float]:
    """Parse /metrics with prometheus_client's parser: {sample name{labels}: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


def processes(title: str) -> dict[int, dict[str, str]]:
    """Environment of each live process whose command line (Ray's process title) holds `title`."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if title in (d / "cmdline").read_bytes().decode(errors="replace"):
                pairs = (e.split("=", 1) for e in (d / "environ").read_bytes().decode(errors="replace").split("\0"))
                out[int(d.name)] = dict(p for p in pairs if len(p) == 2)
        except OSError:  # gone meanwhile
            continue
    return out


def wait_until(pred, timeout=30.0, every=0.2):
    """pred() once it is truthy, polled every `every` s; its last value after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    return pred()


def disconnect_frees_blocks(base_url: str) -> None:
    """A streaming client leaves after 3 chunks: its request is aborted at once and every KV
    block returns to the pool (read from /metrics)."""
    before = metrics(base_url)
    with httpx.Client(timeout=120) as c:
        with c.stream(
            "POST",
            f"{base_url}/v1/completions",
            json={
                "prompt": "Write a very long essay about the sea.",
                "max_tokens": 1000,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            },
        ) as s:
            n = 0
            for line in s.iter_lines():
                n += line.startswith("data:")
                if n >= 3:
                    break
    # The client is gone: the request is aborted and every KV block returns to the pool.
    after = wait_until(
        lambda: (m := metrics(base_url))["orbital:num_requests_running"] == 0
        and m["orbital:kv_cache_usage_perc"] == 0.0
        and m
    )
    assert after, metrics(base_url)
    assert (
        after["orbital:request_success_total{finished_reason=abort}"]
        == before["orbital:request_success_total{finished_reason=abort}"] + 1
    )
    generated = after["orbital:generation_tokens_total"] - before["orbital:generation_tokens_total"]
    assert generated < 200  # stopped long before max_tokens
