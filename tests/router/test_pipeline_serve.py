"""Pipeline-parallel engine replicas behind the router: two Serve replicas of pp=2 (one
placement group of 2 bundles each, PACK), the chat stand-in's two layers one per stage. Greedy
text equals the offline pp=1 engine's; killing a replica's last-stage rank from outside while it
streams moves the request to the other replica, and the client gets exactly the uninterrupted
text."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from tests.failover.conftest import MAX_TOKENS, migrations
from tests.failover.streams import client, complete
from tests.router.conftest import BASE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pp2_url(serve_cluster, chat_stand_in):
    from ray import serve

    from router.app import build_app
    from router.config import AppConfig

    cfg = AppConfig(**BASE, model=chat_stand_in, pipeline_parallel_size=2, num_replicas=2)
    handle = serve.run(build_app(cfg), name="pp2", route_prefix="/pp2")
    yield f"{serve_cluster['url']}/pp2", handle
    serve.delete("pp2")


def test_pp2_matches_pp1(pp2_url, chat_stand_in):
    from engine import LLM, SamplingParams

    url, handle = pp2_url
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    pp2 = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert pp2.status_code == 200, pp2.text
    llm = LLM(chat_stand_in, dtype="float32", kv_cache_memory_bytes=16 << 20, num_threads=1)
    try:
        [pp1] = llm.generate([body["prompt"]], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    finally:
        llm.shutdown()
    assert pp2.json()["choices"][0]["text"] == pp1.outputs[0].text
    health = httpx.get(f"{url}/health", timeout=60).json()
    assert health["status"] == "ok" and health["replicas"] == 2
    stats = handle.replica_stats.remote().result()
    assert all(len(s["rank_pids"]) == 2 for s in stats), stats


async def _kill_a_stage_mid_stream(url: str, handle) -> tuple[tuple, tuple, int]:
    c = client(url)
    prompt = "The lighthouse keeper counted the ships that passed each night. " * 3
    spec = {"name": "greedy-stream", "temperature": 0.0, "stream": True}
    reference = await complete(c, prompt, spec)
    pids = {s["replica_id"]: s["rank_pids"] for s in await handle.replica_stats.remote()}
    killed: list[int] = []

    async def on_chunk(request_id: str, chunks: int) -> None:
        if chunks >= 8 and not killed:  # a chunk may carry several tokens
            decisions = await handle.routing_decisions.remote()
            replica = (decisions.get(request_id) or decisions[f"{request_id}-0"])["replica"]
            killed.append(pids[replica][1])  # rank 1: the last stage, which samples
            os.kill(killed[0], signal.SIGKILL)

    got = await complete(c, prompt, spec, on_chunk)
    assert killed, "the stream ended before its 8th token"
    return reference, got, killed[0]


def test_killed_stage_moves_the_request_with_the_same_text(pp2_url):
    url, handle = pp2_url
    before, failed_before = migrations(url)
    reference, got, victim = asyncio.run(_kill_a_stage_mid_stream(url, handle))
    assert reference[1] == "length" and reference[2] == MAX_TOKENS
    assert got == reference
    after, failed_after = migrations(url)
    assert after - before == 1 and failed_after == failed_before
    with pytest.raises(ProcessLookupError):
        os.kill(victim, 0)
