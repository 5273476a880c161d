"""A tensor-parallel engine replica behind the router: one Serve replica, one placement group
(STRICT_PACK) of 3 bundles, 3 TPWorker ranks serving the chat stand-in (tests/tiny_llama.py:
6 heads, 3 KV heads); greedy output equals the offline tp=1 engine's; a rank killed from outside turns /health to 503 within seconds, and Serve
replaces the replica."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.router.conftest import BASE, processes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp3_app(serve_cluster, chat_stand_in):
    from ray import serve

    from router.app import build_app
    from router.config import AppConfig

    cfg = AppConfig(**BASE, model=chat_stand_in, tensor_parallel_size=3)
    handle = serve.run(build_app(cfg), name="tp3", route_prefix="/tp3")
    yield f"{serve_cluster['url']}/tp3", handle
    serve.delete("tp3")


def test_tp3_matches_tp1(tp3_app, chat_stand_in):
    from engine import LLM, SamplingParams

    url, _ = tp3_app
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    tp3 = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert tp3.status_code == 200, tp3.text
    llm = LLM(chat_stand_in, dtype="float32", kv_cache_memory_bytes=16 << 20, num_threads=1)
    try:
        [tp1] = llm.generate([body["prompt"]], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    finally:
        llm.shutdown()
    assert tp3.json()["choices"][0]["text"] == tp1.outputs[0].text
    health = httpx.get(f"{url}/health", timeout=60).json()
    assert health["status"] == "ok" and health["replicas"] == 1


def _tp_worker_pids(handle) -> list[int]:
    """The remote ranks' processes (1..tp-1) of the app's one replica, from the replica itself:
    other Ray clusters on the machine (another test worker's) run TPWorker processes too."""
    [stats] = handle.replica_stats.remote().result()
    return stats["rank_pids"][1:]


def _alive_rank(pid: int) -> bool:
    """A live TPWorker process (Ray titles them after the actor class); not a zombie's pid."""
    try:
        return b"TPWorker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _wait_health(url: str, status: int, within_s: float) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    while True:
        r = httpx.get(f"{url}/health", timeout=60)
        if r.status_code == status or time.monotonic() - t0 > within_s:
            return r, time.monotonic() - t0
        time.sleep(0.25)


def test_dead_rank_turns_health_503_and_the_replica_is_replaced(tp3_app):
    url, handle = tp3_app
    pids = _tp_worker_pids(handle)
    assert len(pids) == 2 and all(_alive_rank(p) for p in pids), pids  # ranks 1 and 2
    os.kill(pids[0], signal.SIGKILL)
    r, elapsed = _wait_health(url, 503, within_s=30)
    print(f"/health 503 {elapsed:.1f} s after the rank was killed")
    assert r.status_code == 503 and elapsed < 15, (r.status_code, elapsed)
    assert r.json()["status"] == "unavailable" and r.json()["unhealthy"]
    # Serve's own health check fails the same way: it replaces the replica (new ranks too).
    r, elapsed = _wait_health(url, 200, within_s=240)
    print(f"/health 200 again {elapsed:.1f} s later")
    assert r.status_code == 200, r.json()
    assert not _alive_rank(pids[1]) and not set(pids) & set(_tp_worker_pids(handle))  # a new group
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=300).status_code == 200


def test_tensor_parallel_ranks_inherit_the_engines_spin(tp3_app):
    """Ranks 1..tp-1 (TPWorker actors, started by the replica) inherit its runtime env, so every
    rank's OpenMP threads spin as long (router/serve_tuning.py)."""
    from engine import USER_OMP_WAIT
    from router.serve_tuning import ENGINE_OMP_ENV

    if USER_OMP_WAIT:
        pytest.skip("the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT: theirs wins")
    url, handle = tp3_app
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    ranks = {pid: env for pid, env in processes("TPWorker").items() if pid in _tp_worker_pids(handle)}
    assert len(ranks) == 2
    assert all(env.get("GOMP_SPINCOUNT") == ENGINE_OMP_ENV["GOMP_SPINCOUNT"] for env in ranks.values())
