"""Speculative decoding at tp=3 (the embedded model: 3 KV heads, one per rank): drafts verified in
the collective forward give the same greedy tokens as tp=1 without speculation, with prefix
caching on; the verify-step cost table is measured by all ranks together (same table on each)."""

from __future__ import annotations

import json

import pytest

from engine import LLM as EngineLLM
from engine import SamplingParams, StructuredOutput
from tests.engine.test_spec_decode import PROMPTS
from tests.engine.test_structured_outputs import CHAT, PERSON
from workers import LLM

pytestmark = pytest.mark.slow

ARGS = dict(
    dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256, enable_prefix_caching=True, num_threads=1
)
PARAMS = SamplingParams(temperature=0, max_tokens=24)
STRUCTURED = SamplingParams(temperature=0, max_tokens=48, structured_output=StructuredOutput("json", PERSON))
STRUCTURED_PROMPTS = [
    CHAT.format(
        'Copy this JSON: {"name": "Ann", "age": 31, "city": "Oslo"} {"name": "Ann", "age": 31, "city": "Oslo"}'
    ),
    CHAT.format("Describe a person as JSON."),
]


@pytest.fixture(scope="module")
def expected():
    """The greedy tokens at tp=1 without speculation, which both tests must reproduce."""
    base = EngineLLM(**ARGS)
    try:
        return [o.outputs[0].token_ids for o in base.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        base.shutdown()


@pytest.fixture(scope="module")
def expected_structured():
    """Greedy JSON-schema outputs at tp=1 without speculation."""
    base = EngineLLM(**ARGS)
    try:
        return [o.outputs[0].token_ids for o in base.generate(STRUCTURED_PROMPTS, STRUCTURED, use_tqdm=False)]
    finally:
        base.shutdown()


def test_tp3_speculative_equals_tp1_without(ray_local, expected, expected_structured):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}  # every draft verified
    llm = LLM(tensor_parallel_size=3, speculative_config=spec, **ARGS)
    try:
        # What an adaptive engine measures at start-up, here on the fresh pool: all ranks at once.
        table = llm.engine.core.executor.measure_step_costs(2, 3)
        assert {(b, k) for b in (1, 2) for k in range(4)} <= set(table) and min(table.values()) > 0, table
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]  # cache hits
        # Structured outputs: the bitmasks travel to the sampling rank with the step's drafts.
        structured = llm.generate(STRUCTURED_PROMPTS, STRUCTURED, use_tqdm=False)
        stats = llm.stats()
        assert stats["blocks_used"] == 0
    finally:
        llm.shutdown()
    assert got == expected and again == expected
    assert [o.outputs[0].token_ids for o in structured] == expected_structured
    for o in structured:
        assert set(json.loads(o.outputs[0].text)) == {"name", "age", "city"}
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats


def test_tp3_with_self_drafting_equals_tp1_without(ray_local, expected):
    """The draft (the target's first 8 layers, loaded at tp=1 in the engine's process, since
    the target's weights are sharded over three processes) proposes; the tp=3 target verifies."""
    spec = {"method": "self", "draft_layers": 8, "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(tensor_parallel_size=3, speculative_config=spec, **ARGS)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]  # cache hits
        stats = llm.stats()
        draft = llm.engine.core.scheduler.drafting.draft_model
        assert stats["blocks_used"] == 0 and draft.num_blocks_used() == 0
    finally:
        llm.shutdown()
    assert got == expected and again == expected
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats


def test_pp2_speculative_and_structured_equal_pp1_without(ray_local, expected, expected_structured):
    """Two pipeline stages of 15 layers: the drafts and the grammar's bitmasks reach the last
    stage, which samples; the first stage learns the accepted tokens with the next step."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(pipeline_parallel_size=2, speculative_config=spec, **ARGS)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        structured = llm.generate(STRUCTURED_PROMPTS, STRUCTURED, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert got == expected
    assert [o.outputs[0].token_ids for o in structured] == expected_structured
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats
    assert stats["blocks_used"] == 0
