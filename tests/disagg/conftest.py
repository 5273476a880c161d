"""One Ray cluster + Serve app for tests/disagg: a disaggregated app of the embedded model
(float32, one torch thread per process): 1 prefill replica + 1 decode replica behind the router,
prompts with more than LOCAL_MAX uncached tokens prefilled remotely. Faults come from outside
(SIGKILL of the prefill replica's process, a client that hangs up). Everything is shut down at
the end."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.router.conftest import BASE, metrics
from tests.serve_cluster import serve_app

APP = "pd"
LOCAL_MAX = 16
BLOCK_BYTES = 2 * 30 * 3 * 16 * 64 * 4  # SmolLM2-135M, float32, 16-token blocks: all layers, K and V
# The AppConfig fields every P/D app of these tests shares (one torch thread per process).
PD_BASE = dict(
    BASE,
    kv_cache_memory_bytes=32 << 20,
    num_replicas=1,
    prefill_replicas=1,
    local_prefill_max_tokens=LOCAL_MAX,
)


@pytest.fixture(scope="package")
def pd_cluster():
    with serve_app(APP, **PD_BASE) as cluster:
        yield cluster


@pytest.fixture(scope="package")
def reference_llm():
    """The colocated engine, offline, same settings: what P/D must reproduce."""
    from engine import LLM

    llm = LLM(dtype="float32", kv_cache_memory_bytes=32 << 20, num_threads=1)
    yield llm
    llm.shutdown()


def transfer_counters(url: str) -> dict[str, float]:
    page = metrics(url)
    keys = (
        "kv_transfers",
        "kv_transfer_blocks",
        "kv_transfer_bytes",
        "kv_transfer_failures",
        "num_remote_prefills",
        "num_local_prefills",
    )
    return {k: page.get(f"orbital:{k}_total", 0.0) for k in keys}


async def wait_pools_idle(handle, timeout: float = 30.0) -> dict[str, list[dict]]:
    """Until both pools hold no KV block and no request (every block back in its pool)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = {
            "decode": await handle.replica_stats.remote(),
            "prefill": await handle.replica_stats.remote("prefill"),
        }
        busy = [
            (role, s["replica_id"], s["blocks_used"], s["num_running"], s["num_waiting"])
            for role, ss in stats.items()
            for s in ss
            if s["blocks_used"] or s["num_running"] or s["num_waiting"] or s.get("num_waiting_for_remote_kv")
        ]
        if not busy:
            return stats
        assert time.monotonic() < deadline, f"pools still hold blocks or requests: {busy}"
        await asyncio.sleep(0.5)
