"""One Ray cluster + Serve app for tests/failover: 4 engine replicas of the chat stand-in
(tests/tiny_llama.py: the embedded model's tokenizer on a 2-layer random Llama; float32, one
torch thread each) behind the cache-aware router, a 3 s drain budget. Faults come
from outside: the tests SIGKILL a replica's process (its pid is in `replica_stats`) or redeploy
with fewer replicas. Serve replaces a killed replica only after 40-110 s, so 4 replicas leave
room for several kills in a row. Everything is shut down at the end."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.router.conftest import BASE, metrics
from tests.serve_cluster import serve_app
from tests.tiny_llama import chat_stand_in_block_bytes

APP = "failover"
MAX_TOKENS = 64


@pytest.fixture(scope="package")
def failover_cluster(tmp_path_factory, chat_stand_in):
    # A watermark key: the seeded stream is watermarked (streams.py), so a moved watermarked
    # request must also resume with exactly its uninterrupted tokens.
    key = tmp_path_factory.mktemp("wm") / "key"
    key.write_text("8675309\n")
    config = {
        **BASE,
        "model": chat_stand_in,
        "kv_cache_memory_bytes": 256 * chat_stand_in_block_bytes(),
        "watermark_key_file": str(key),
    }
    with serve_app(APP, **config, num_replicas=4, drain_timeout_s=3.0) as cluster:
        yield cluster


def migrations(url: str) -> tuple[float, float]:
    """(requests moved, requests that could not move) as /metrics counts them."""
    page = metrics(url)
    return page.get("orbital:router_migrations_total", 0.0), page.get("orbital:router_migration_failures_total", 0.0)


async def live_replicas(handle) -> dict[str, int]:
    """Replica id -> pid of the engine replicas that answer."""
    return {s["replica_id"]: s["pid"] for s in await handle.replica_stats.remote()}


async def wait_live(handle, n: int, timeout: float = 240.0) -> dict[str, int]:
    """Until at least `n` engine replicas answer (Serve replaces killed ones)."""
    deadline = time.monotonic() + timeout
    while True:
        live = await live_replicas(handle)
        if len(live) >= n or time.monotonic() > deadline:
            assert len(live) >= n, f"only {len(live)} engine replicas came back"
            return live
        await asyncio.sleep(1.0)


async def kill_replica_of(handle, request_id: str, pids: dict[str, int]) -> str:
    """SIGKILL the process of the engine replica running `request_id`; returns its id."""
    decisions = await handle.routing_decisions.remote()
    # A completion's engine request is `<id>-<prompt index>`.
    replica = (decisions.get(request_id) or decisions[f"{request_id}-0"])["replica"]
    os.kill(pids[replica], signal.SIGKILL)
    return replica
