"""Operations: /health, /metrics (parsed, moving with traffic), disconnect frees KV blocks,
overload gets 429 + Retry-After while accepted requests finish, API key, timeout, two replicas."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.router.conftest import disconnect_frees_blocks, metrics, processes, wait_until

pytestmark = pytest.mark.slow


def test_health(base_url, serve_cluster):
    r = httpx.get(f"{base_url}/health", timeout=30)
    assert r.status_code == 200 and r.json()["replicas"] == 2


def test_metrics_move_with_traffic(base_url):
    before = metrics(base_url)
    for name in (
        "orbital:num_requests_running",
        "orbital:num_requests_waiting",
        "orbital:kv_cache_usage_perc",
        "orbital:prefix_cache_queries_total",
        "orbital:prefix_cache_hits_total",
        "orbital:num_preemptions_total",
        "orbital:prompt_tokens_total",
        "orbital:generation_tokens_total",
        "orbital:time_to_first_token_seconds_count",
        "orbital:inter_token_latency_seconds_count",
        "orbital:e2e_request_latency_seconds_count",
        "orbital:request_queue_time_seconds_count",
    ):
        assert name in before, name
    prompt = "A shared prefix that is long enough to fill at least one whole KV block of sixteen tokens. " * 2
    for _ in range(2):
        r = httpx.post(
            f"{base_url}/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0}, timeout=60
        )
        assert r.status_code == 200
    after = metrics(base_url)
    assert after["orbital:generation_tokens_total"] >= before["orbital:generation_tokens_total"] + 10
    assert after["orbital:prompt_tokens_total"] > before["orbital:prompt_tokens_total"]
    assert after["orbital:time_to_first_token_seconds_count"] >= before["orbital:time_to_first_token_seconds_count"] + 2
    assert after["orbital:inter_token_latency_seconds_count"] >= before["orbital:inter_token_latency_seconds_count"] + 8
    assert after["orbital:e2e_request_latency_seconds_count"] >= before["orbital:e2e_request_latency_seconds_count"] + 2
    assert after["orbital:prefix_cache_queries_total"] > before["orbital:prefix_cache_queries_total"]
    # Every replica runs on the router's node: the outputs came over its local socket, none as call items.
    socket, call = "orbital:router_output_socket_messages_total", "orbital:router_output_call_messages_total"
    assert after[socket] >= before[socket] + 2 and after[call] == before[call] == 0
    assert (
        after["orbital:request_success_total{finished_reason=length}"]
        >= before["orbital:request_success_total{finished_reason=length}"] + 2
    )


def test_disconnect_frees_blocks(base_url):
    disconnect_frees_blocks(base_url)


async def _overload(url: str, key: str, n: int):
    headers = {"Authorization": f"Bearer {key}"}
    body = {"prompt": "Count to twenty:", "max_tokens": 24, "ignore_eos": True, "temperature": 0}

    async with httpx.AsyncClient(timeout=120, headers=headers) as c:

        async def one():
            t = time.monotonic()
            r = await c.post(f"{url}/v1/completions", json=body)
            return r, time.monotonic() - t

        return await asyncio.gather(*(one() for _ in range(n)))


def test_overload_429(serve_cluster):
    url, key = serve_cluster["strict_url"], serve_cluster["strict_key"]
    results = asyncio.run(_overload(url, key, 12))
    ok = [(r, t) for r, t in results if r.status_code == 200]
    busy = [(r, t) for r, t in results if r.status_code == 429]
    assert len(ok) + len(busy) == 12, [r.status_code for r, _ in results]
    assert ok and busy
    for r, _ in busy:
        assert 1 <= int(r.headers["retry-after"]) <= 60  # from the queue's drain rate (test_units)
        assert r.json()["error"]["type"] == "rate_limit_error"
    for r, _ in ok:
        assert r.json()["usage"]["completion_tokens"] == 24
    assert max(t for _, t in busy) < min(t for _, t in ok)  # refused at once, before any finished
    m = metrics(url, headers={"Authorization": f"Bearer {key}"})
    assert m["orbital:num_requests_rejected_total"] >= len(busy)


def test_api_key(serve_cluster):
    url, key = serve_cluster["strict_url"], serve_cluster["strict_key"]
    body = {"prompt": "hi", "max_tokens": 1}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # operations stay open


def test_request_timeout(serve_cluster):
    url, key = serve_cluster["strict_url"], serve_cluster["strict_key"]
    headers = {"Authorization": f"Bearer {key}"}
    t = time.monotonic()
    r = httpx.post(
        f"{url}/v1/completions",
        timeout=120,
        headers=headers,
        json={"prompt": "Go on forever:", "max_tokens": 1200, "ignore_eos": True},
    )
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert time.monotonic() - t < 30
    done = wait_until(lambda: metrics(url, headers)["orbital:num_requests_running"] == 0)
    assert done  # the timed-out request was aborted in the engine


def test_two_replicas_share_load(serve_cluster, base_url):
    async def burst():
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(
                *(
                    c.post(
                        f"{base_url}/v1/completions",
                        json={"prompt": f"Number {i}:", "max_tokens": 6, "ignore_eos": True},
                    )
                    for i in range(8)
                )
            )
            return [r.status_code for r in rs]

    assert asyncio.run(burst()) == [200] * 8
    counts = serve_cluster["handle"].routed_counts.remote().result()
    assert len(counts) == 2 and all(v >= 2 for v in counts.values()), counts


def test_pinned_calls_reach_their_replica_under_concurrency(serve_cluster):
    """A call pinned with `replica_id` must run on that replica even when many pinned calls wait
    at once (stop-string `finish`, `abort` and output channels rely on it)."""
    from ray import serve

    engine = serve.get_deployment_handle("EngineReplica", app_name="main")
    # Both replicas' ids from the ingress's fan-out: unpinned calls go to the least loaded one,
    # and one replica's routing stats can still show the load of an earlier test.
    ids = sorted(s["replica_id"] for s in serve_cluster["handle"].replica_stats.remote().result())
    assert len(ids) == 2, ids

    async def burst():
        targets = [ids[i % 2] for i in range(60)]
        got = await asyncio.gather(*(engine.stats.remote(replica_id=t) for t in targets))
        return [(t, g["replica_id"]) for t, g in zip(targets, got)]

    pairs = asyncio.run(burst())
    assert all(t == g for t, g in pairs), [p for p in pairs if p[0] != p[1]]


def test_call_pinned_to_a_gone_replica_fails_at_once(serve_cluster):
    """A replica that left the router's list (stopped, replaced) answers nothing: a call pinned
    to it fails with a 503-class error at once instead of waiting for its timeout."""
    from ray import serve

    from router.replica_choice.request_router import ReplicaGoneError

    engine = serve.get_deployment_handle("EngineReplica", app_name="main")
    engine.stats.remote().result()  # the handle's router knows the replicas
    t0 = time.monotonic()
    with pytest.raises(ReplicaGoneError):
        engine.stats.remote(replica_id="no-such-replica").result(timeout_s=30)
    assert time.monotonic() - t0 < 5
    assert engine.stats.remote().result()["replica_id"]  # the router still routes


def test_disconnects_leave_other_streams_alone(base_url):
    """Clients that open the first streams on each replica (their requests open the router's
    output channels) go away while others stream: the others finish in full, and every
    request that left is aborted at once (Serve cancels a cancelled request's calls: the
    channel and `abort` must not be among them)."""
    before = metrics(base_url)
    body = {
        "max_tokens": 40,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            started = [asyncio.Event() for _ in range(6)]
            go = asyncio.Event()

            async def client(i: int, leave: bool):
                tokens = 0
                async with c.stream(
                    "POST", f"{base_url}/v1/completions", json={**body, "prompt": f"Tell a story, number {i}:"}
                ) as s:
                    async for line in s.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        started[i].set()
                        if leave:
                            await go.wait()
                            return None
                        usage = json.loads(line[6:]).get("usage")
                        tokens = usage["completion_tokens"] if usage else tokens
                return tokens

            leavers = [asyncio.create_task(client(i, True)) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(started[i].wait() for i in range(2))), 30)
            stayers = [asyncio.create_task(client(i, False)) for i in range(2, 6)]
            await asyncio.wait_for(asyncio.gather(*(started[i].wait() for i in range(2, 6))), 30)
            go.set()
            await asyncio.gather(*leavers)
            return await asyncio.gather(*stayers)

    assert asyncio.run(run()) == [40] * 4
    after = wait_until(
        lambda: (m := metrics(base_url))["orbital:num_requests_running"] == 0
        and m["orbital:kv_cache_usage_perc"] == 0.0
        and m,
        timeout=10,
    )
    assert after, metrics(base_url)
    assert (
        after["orbital:request_success_total{finished_reason=abort}"]
        == before["orbital:request_success_total{finished_reason=abort}"] + 2
    )


def test_engine_replicas_spin_longer_than_the_offline_default(serve_cluster):
    """The engine replicas' OpenMP threads spin ~2 ms before sleeping (router/serve_tuning.py);
    this test's own process has the offline default, which the rest of Ray inherits."""
    from engine import USER_OMP_WAIT
    from router.serve_tuning import ENGINE_OMP_ENV

    if USER_OMP_WAIT:
        pytest.skip("the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT: theirs wins")
    engines = processes("EngineReplica")
    assert len(engines) >= 3  # main's two replicas and strict's one
    assert all(env.get("GOMP_SPINCOUNT") == ENGINE_OMP_ENV["GOMP_SPINCOUNT"] for env in engines.values())
    ingresses = processes("Ingress")
    assert ingresses and all(env.get("GOMP_SPINCOUNT") == "2000" for env in ingresses.values())
