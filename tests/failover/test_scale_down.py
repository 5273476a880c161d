"""A redeploy with fewer engine replicas (4 -> 2) during traffic: the removed replicas take no new
requests, their streams drain for `drain_timeout_s` (3 s here) and the rest move; every stream
finishes with the text of its uninterrupted run. Runs last in the package (it shrinks the app)."""

from __future__ import annotations

import asyncio

import pytest

from tests.failover.conftest import APP, migrations
from tests.failover.streams import SPECS, client, complete

pytestmark = pytest.mark.slow

STREAMS = 6


def test_scale_down_during_traffic_finishes_every_stream(failover_cluster):
    from ray import serve

    from router.app import build_app

    url, cfg = failover_cluster["url"], failover_cluster["cfg"]
    spec = SPECS[0]  # greedy, streamed
    prompts = [f"Log {i}. " + "The keeper wrote down the weather, the wind and the ships. " * 3 for i in range(STREAMS)]

    async def run() -> tuple[list, list]:
        c = client(url)
        reference = await asyncio.gather(*(complete(c, p, spec) for p in prompts))
        started = asyncio.Event()
        seen: set[str] = set()  # streams that have their first tokens

        async def on_chunk(request_id: str, tokens: int) -> None:
            if tokens >= 2:
                seen.add(request_id)
                if len(seen) == STREAMS:
                    started.set()

        streams = [asyncio.ensure_future(complete(c, p, spec, on_chunk)) for p in prompts]
        await asyncio.wait_for(started.wait(), 120)
        smaller = build_app(cfg.model_copy(update={"num_replicas": 2}))
        await asyncio.to_thread(serve.run, smaller, name=APP, route_prefix="/")
        return reference, await asyncio.gather(*streams)

    reference, got = asyncio.run(run())
    assert got == reference
    # The redeploy replaced the router too (its config changed), so its counters start again.
    assert migrations(url)[1] == 0
