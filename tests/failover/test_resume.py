"""The engine side of failover, without Ray: a request resumed with the output tokens another
replica generated (`generate_tokens(resume=...)`) continues exactly as the uninterrupted run,
for greedy, seeded (keyed by output position), penalties and n>1 (each child its own seed and
outputs; a finished child is not resumed). A tiny random Llama, float32."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.engine_args import EngineArgs
from engine.request import child_request_ids
from engine.sampling_params import SamplingParams
from tests.engine.test_tiny_models import _save_tiny

MAX = 24
CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=MAX, ignore_eos=True),
    "penalties": SamplingParams(
        temperature=0.8, seed=3, repetition_penalty=1.3, presence_penalty=0.5, min_tokens=MAX, max_tokens=MAX
    ),
    "n2": SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=MAX, ignore_eos=True),
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm_tokenizer):
    path = tmp_path_factory.mktemp("tiny")
    _save_tiny("llama3", path, smollm_tokenizer)
    eng = AsyncEngine(EngineArgs(model=str(path), dtype="float32", num_blocks=64, block_size=8, num_threads=1))
    yield eng
    eng.shutdown()


async def _run(eng: AsyncEngine, rid: str, ids: list[int], params: SamplingParams, resume=None) -> dict[str, list]:
    got: dict[str, list[int]] = {}
    async for out in eng.generate_tokens(rid, ids, params, resume=resume):
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return got


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_request_continues_exactly(engine, case):
    params = CASES[case]
    ids = engine.tokenizer("The keeper of the lighthouse wrote").input_ids
    children = child_request_ids(f"{case}-full", params.n)
    full = asyncio.run(_run(engine, f"{case}-full", ids, params))
    assert sorted(full) == sorted(children) and all(len(v) == MAX for v in full.values())
    for k in (0, 1, MAX // 2, MAX - 1):
        rid = f"{case}-at-{k}"
        # Each child moves with its first k outputs (child ids follow the new request id).
        resume = {c: full[f].copy()[:k] for c, f in zip(child_request_ids(rid, params.n), children)}
        if params.n > 1 and k:  # the first child finished before the move: only the second goes on
            del resume[f"{rid}#0"]
        rest = asyncio.run(_run(engine, rid, ids, params, resume))
        assert sorted(rest) == sorted(resume), (case, k)
        for c, f in zip(child_request_ids(rid, params.n), children):
            if c in resume:
                assert resume[c] + rest[c] == full[f], (case, k, c)
    assert engine.stats()["blocks_used"] == 0
