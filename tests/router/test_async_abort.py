"""What the router's cancellation relies on, without Ray: dropping an AsyncEngine token stream
(the replica's generator closed or cancelled) aborts the request before the next steps and every
KV block returns to the pool."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.engine_args import EngineArgs
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine(EngineArgs(dtype="float32", kv_cache_memory_bytes=64 << 20, num_threads=1))
    yield eng
    eng.shutdown()


def _idle(eng: AsyncEngine, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = eng.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["blocks_used"] == 0:
            return s
        time.sleep(0.05)
    return eng.stats()


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_dropped_token_stream_aborts(engine, how):
    ids = engine.tokenizer("Write a long story about the sea.").input_ids
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def consume():
        stream = engine.generate_tokens(f"abort-{how}", ids, params)
        n = 0
        if how == "aclose":
            async for out in stream:
                n += len(out.new_token_ids)
                if n >= 3:
                    break
            await stream.aclose()
        else:

            async def reader():
                nonlocal n
                async for out in stream:
                    n += len(out.new_token_ids)

            task = asyncio.create_task(reader())
            while n < 3:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        return n

    steps_before = engine.step_count
    asyncio.run(consume())
    s = _idle(engine)
    assert s["num_running"] == 0 and s["blocks_used"] == 0, s
    assert engine.step_count - steps_before < 60  # far from the 500 tokens asked for


def test_engine_that_fails_to_build_raises_in_the_caller(tmp_path):
    """The step thread builds the engine (one OpenMP team for load and steps); a build error
    still reaches the caller, and the failed engine leaves no thread behind."""
    with pytest.raises(Exception) as err:
        AsyncEngine(EngineArgs(model=str(tmp_path / "no-such-model"), num_threads=1))
    assert "no-such-model" in str(err.value)


def test_health_reports_a_step_in_flight_past_the_bound(engine):
    """A step longer than the bound (here a 1200-token prompt against a 10 ms bound) is what a
    hung collective looks like from outside: check_health names it; idle, it passes again."""
    from engine.errors import EngineDeadError

    ids = (engine.tokenizer("The sea is wide and deep. ").input_ids * 200)[:1200]  # the pool holds 1456
    params = SamplingParams(temperature=0.0, max_tokens=1)

    async def run() -> list[str]:
        seen: list[str] = []

        async def consume():
            async for out in engine.generate_tokens("long-step", ids, params):
                assert out.error is None, out.error

        task = asyncio.create_task(consume())
        while not task.done():
            try:
                engine.check_health(stuck_after_s=0.01)
            except EngineDeadError as e:
                seen.append(str(e))
            await asyncio.sleep(0.005)
        await task
        return seen

    seen = asyncio.run(run())
    assert seen and "has not returned for" in seen[0], seen
    engine.check_health(stuck_after_s=0.01)  # idle: healthy
    assert _idle(engine)["blocks_used"] == 0
