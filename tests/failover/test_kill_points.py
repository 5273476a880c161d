"""SIGKILL the engine replica serving a stream at its first, a middle and a late token, while
three more requests with the same prompt run (greedy and seeded, streamed and not; the
cache-aware router puts most of them on the same replica): every client gets exactly the text,
finish reason and usage of an uninterrupted run of the same request, once, and /metrics counts
the moves (none failed)."""

from __future__ import annotations

import asyncio

import pytest

from tests.failover.conftest import LATEST_KILL, MAX_TOKENS, KillAt, migrations, wait_live
from tests.failover.streams import SPECS, client, complete

pytestmark = pytest.mark.slow


async def _round(url: str, handle, prompt: str, kill_at: int) -> tuple[list, list, str]:
    c = client(url)
    # Uninterrupted run first: the reference, and it leaves the prompt cached on one replica,
    # so the cache-aware router sends the four requests below there together.
    reference = await asyncio.gather(*(complete(c, prompt, s) for s in SPECS))
    pids = await wait_live(handle, 2)
    kill = KillAt(handle, pids, kill_at)
    got = await asyncio.gather(*(complete(c, prompt, s, kill if i == 0 else None) for i, s in enumerate(SPECS)))
    assert kill.killed, kill_at
    return reference, got, kill.killed


@pytest.mark.parametrize("point", ["first", "middle", "late"])
def test_kill_at_a_token_resumes_exactly(failover_cluster, point):
    url, handle = failover_cluster["url"], failover_cluster["handle"]
    kill_at = {"first": 1, "middle": MAX_TOKENS // 2, "late": LATEST_KILL}[point]
    before, failed_before = migrations(url)
    # Several KV blocks long: the cache-aware router places all four where the prompt is cached.
    prompt = f"Story {point}. " + "The lighthouse keeper counted the ships that passed each night. " * 6
    reference, got, victim = asyncio.run(_round(url, handle, prompt, kill_at))
    for spec, ref, out in zip(SPECS, reference, got):
        assert ref[1] == "length" and ref[2] == MAX_TOKENS, (spec["name"], ref)
        assert out == ref, (spec["name"], point)
    after, failed_after = migrations(url)
    assert failed_after == failed_before
    # The stream that triggered the kill moved; the cache-aware router usually placed 2-4 of the
    # four on that replica (the load guard may spread them), and each of those moved too.
    assert 1 <= after - before <= len(SPECS), (after - before, victim)
