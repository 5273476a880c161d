"""The other routes and shapes survive a replica kill too: TGI's /generate_stream (through
huggingface_hub's client) and an OpenAI request with n=2, streamed and not. The engine replica
serving the request is SIGKILLed at a middle token; every client gets exactly the uninterrupted
run's output, once."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.failover.conftest import MAX_TOKENS, kill_replica_of, migrations, wait_live
from tests.failover.streams import client

pytestmark = pytest.mark.slow

PROMPT = "Route test. " + "The harbour lights flickered while the tide came in slowly. " * 4


async def _tgi(url: str, on_token=None) -> tuple[str, str, int]:
    from huggingface_hub import AsyncInferenceClient

    c = AsyncInferenceClient(base_url=url, timeout=300)
    text, details, n = "", None, 0
    stream = await c.text_generation(
        PROMPT, max_new_tokens=MAX_TOKENS, do_sample=True, temperature=0.8, seed=5, stream=True, details=True
    )
    async for ev in stream:
        n += 1
        if not ev.token.special:
            text += ev.token.text
        details = ev.details or details
        if on_token is not None:
            await on_token(n)
    return text, details.finish_reason, details.generated_tokens


async def _kill_latest(handle, pids: dict[str, int]) -> str:
    """SIGKILL the replica of the router's most recent decision (the one request in flight)."""
    replica = list((await handle.routing_decisions.remote()).values())[-1]["replica"]
    os.kill(pids[replica], signal.SIGKILL)
    return replica


def test_tgi_stream_resumes_exactly(failover_cluster):
    url, handle = failover_cluster["url"], failover_cluster["handle"]
    before, failed_before = migrations(url)

    async def run():
        reference = await _tgi(url)
        pids = await wait_live(handle, 2)
        killed: list[str] = []

        async def on_token(n: int) -> None:
            if n == MAX_TOKENS // 2 and not killed:
                killed.append(await _kill_latest(handle, pids))

        return reference, await _tgi(url, on_token), killed

    reference, got, killed = asyncio.run(run())
    assert killed and got == reference, (got, reference)
    after, failed_after = migrations(url)
    assert after == before + 1 and failed_after == failed_before


# A non-streamed request is killed after a fixed delay, so it must run long enough to be caught.
NONSTREAM_TOKENS = 768


async def _n2(url: str, stream: bool, handle=None, pids=None) -> tuple[list[str], list[str], int]:
    c = client(url)
    kw = dict(
        model=(await c.models.list()).data[0].id,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS if stream else NONSTREAM_TOKENS,
        n=2,
        temperature=0.9,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    if not stream:
        if handle is not None:  # kill while it runs: once the router has placed it
            seen = set(await handle.routing_decisions.remote())
            task = asyncio.ensure_future(c.completions.create(**kw))
            while not (new := set(await handle.routing_decisions.remote()) - seen):
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # a few of its NONSTREAM_TOKENS (~3 s of decoding) are out
            await kill_replica_of(handle, next(iter(new)).rsplit("-", 1)[0], pids)
            r = await task
        else:
            r = await c.completions.create(**kw)
        ch = sorted(r.choices, key=lambda x: x.index)
        return [x.text for x in ch], [x.finish_reason for x in ch], r.usage.completion_tokens
    texts, finish, tokens, chunks, killed = ["", ""], [None, None], None, 0, False
    async for ch in await c.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            tokens = ch.usage.completion_tokens
        for choice in ch.choices:
            texts[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason or finish[choice.index]
            chunks += 1
            if handle is not None and chunks >= MAX_TOKENS and not killed:
                killed = bool(await kill_replica_of(handle, ch.id, pids))
    return texts, finish, tokens


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "nonstream"])
def test_n2_resumes_exactly(failover_cluster, stream):
    url, handle = failover_cluster["url"], failover_cluster["handle"]
    before, failed_before = migrations(url)

    async def run():
        reference = await _n2(url, stream)
        pids = await wait_live(handle, 2)
        return reference, await _n2(url, stream, handle, pids)

    reference, got = asyncio.run(run())
    assert got == reference and got[2] == 2 * (MAX_TOKENS if stream else NONSTREAM_TOKENS), (got, reference)
    after, failed_after = migrations(url)
    assert after == before + 1 and failed_after == failed_before


STORY = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 30}, "story": {"type": "string", "minLength": 120}},
    "required": ["title", "story"],
    "additionalProperties": False,
}


async def _structured(url: str, handle=None, pids=None) -> tuple[str, str]:
    """A sampled chat stream held to a JSON schema; with `handle`, its replica is killed at the
    10th chunk (the moved request's grammar replays the output it brings)."""
    c = client(url)
    stream = await c.chat.completions.create(
        model=(await c.models.list()).data[0].id,
        messages=[{"role": "user", "content": "Tell a short story about the harbour, as JSON."}],
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        seed=9,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "story", "schema": STORY}},
    )
    text, finish, chunks, killed = "", None, 0, False
    async for ch in stream:
        for choice in ch.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            chunks += 1
            if handle is not None and chunks >= 10 and not killed:
                killed = bool(await kill_replica_of(handle, ch.id, pids))
    assert handle is None or killed
    return text, finish


def test_structured_output_stream_resumes_exactly(failover_cluster):
    url, handle = failover_cluster["url"], failover_cluster["handle"]
    before, failed_before = migrations(url)

    async def run():
        reference = await _structured(url)
        pids = await wait_live(handle, 2)
        return reference, await _structured(url, handle, pids)

    reference, got = asyncio.run(run())
    assert got == reference, (got, reference)
    assert got[0].startswith('{"title": "')
    after, failed_after = migrations(url)
    assert after == before + 1 and failed_after == failed_before
