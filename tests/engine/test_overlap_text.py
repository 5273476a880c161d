"""Overlapped stepping (`overlap_text`, on by default on CUDA): the next step is launched before
the last one's text is made. On CPU a launch runs the step to its end, so the results must equal
plain stepping exactly; these tests force it on to check the ordering logic itself: stop strings
found a step late, aborts while a step is in flight, n > 1, logprobs, and every block returned."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.engine_args import EngineArgs

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "List three colours:",
    "The quick brown fox",
    "In 1905, Albert Einstein",
]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=24, stop=[" is", "."]),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=7, n=2),
        SamplingParams(temperature=0, max_tokens=30, stop=["\n\n"], logprobs=2),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=3, seed=3, prompt_logprobs=1),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.5, max_tokens=16, seed=11, stop=["Einstein"], include_stop_str_in_output=True),
    ]


def _llm(overlap: bool) -> LLM:
    return LLM(dtype="float32", kv_cache_memory_bytes=64 << 20, num_threads=2, max_model_len=512, overlap_text=overlap)


@pytest.fixture(scope="module")
def llms():
    return _llm(False), _llm(True)


def _summary(outs):
    return [
        [(c.text, list(c.token_ids), c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs]
        + [o.prompt_logprobs]
        for o in outs
    ]


def test_overlapped_outputs_equal_plain(llms):
    plain, overlapped = llms
    assert overlapped.engine.overlap_text and not plain.engine.overlap_text
    a = plain.generate(PROMPTS, _params(), use_tqdm=False)
    b = overlapped.generate(PROMPTS, _params(), use_tqdm=False)
    assert _summary(a) == _summary(b)
    assert any(c.finish_reason == "stop" and isinstance(c.stop_reason, str) for o in b for c in o.outputs)
    for llm in llms:
        assert llm.stats()["blocks_used"] == 0 and not llm.engine.step_in_flight


def test_abort_while_a_step_is_in_flight(llms):
    _, llm = llms
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    ids = [eng.add_request(None, p, sp) for p in PROMPTS[:3]]
    for _ in range(4):
        eng.step()
    assert eng.step_in_flight  # the next step was launched before these outputs were returned
    eng.abort_request(ids[1])
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id != ids[1]
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {ids[0], ids[2]}
    assert all(len(done[r].outputs[0].token_ids) == 50 for r in done)
    assert llm.stats()["blocks_used"] == 0


def test_async_engine_overlapped_streams():
    """The serving loop's overlapped path: every stream ends, text equals the offline result."""

    async def run():
        args = EngineArgs(
            dtype="float32", kv_cache_memory_bytes=64 << 20, num_threads=2, max_model_len=512, overlap_text=True
        )
        eng = AsyncEngine(args)
        try:
            assert eng.engine.overlap_text

            async def one(i, p):
                last = None
                async for out in eng.generate(p, SamplingParams(temperature=0, max_tokens=12), f"r{i}"):
                    last = out
                return last.outputs[0].text

            texts = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
            stats = eng.stats()
        finally:
            eng.shutdown()
        return texts, stats

    texts, stats = asyncio.run(run())
    plain = _llm(False).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert texts == [o.outputs[0].text for o in plain]
    assert stats["blocks_used"] == 0
