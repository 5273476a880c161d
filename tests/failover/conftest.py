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
# The latest token a kill is aimed at. The client reads a stream a few tokens behind the engine
# (router and HTTP hops), and the tiny model makes a token in milliseconds, so a kill aimed at the
# last token or two can land after the request finished and move nothing.
LATEST_KILL = MAX_TOKENS - 8


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


async def replica_of(handle, request_id: str) -> str:
    """The engine replica the router sent `request_id` to."""
    decisions = await handle.routing_decisions.remote()
    # A completion's engine request is `<id>-<prompt index>`.
    return (decisions.get(request_id) or decisions[f"{request_id}-0"])["replica"]


async def kill_replica_of(handle, request_id: str, pids: dict[str, int]) -> str:
    """SIGKILL the process of the engine replica running `request_id`; returns its id."""
    replica = await replica_of(handle, request_id)
    os.kill(pids[replica], signal.SIGKILL)
    return replica


class KillAt:
    """An `on_chunk` callback that SIGKILLs the replica serving a stream once the client has read
    `kill_at` tokens. The replica is looked up on the first chunk, so the kill itself is one
    signal and lands at the aimed token rather than a handle call later."""

    def __init__(self, handle, pids: dict[str, int], kill_at: int):
        self.handle, self.pids, self.kill_at = handle, pids, kill_at
        self.replica: str | None = None
        self.killed: str | None = None

    async def __call__(self, request_id: str, tokens: int) -> None:
        if self.replica is None:
            self.replica = await replica_of(self.handle, request_id)
        if tokens >= self.kill_at and self.killed is None:
            os.kill(self.pids[self.replica], signal.SIGKILL)
            self.killed = self.replica
