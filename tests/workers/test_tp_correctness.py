"""Tensor parallel (rank 0 in the driver, ranks 1.. as Ray actors) gives the same greedy tokens
as tp=1 and as transformers (float32), logprobs within 1e-3, with prefix caching and chunked
prefill on; shards are 1/tp on every rank, the driver's rank 0 included."""

from __future__ import annotations

import dataclasses
import os

import pytest

from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.model.loader import parameter_bytes
from engine.watermark import Watermark
from tests.workers.conftest import hf_greedy
from workers import LLM

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

NEW = 12
SHARED = list(range(40, 80))  # 10 blocks of 4: later prompts hit the prefix cache
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    [100, 200, 300],
    [7],
    SHARED + [11, 12, 13],
    list(range(300, 350)),  # several chunks of 16 tokens
    SHARED[:38] + [500, 501, 502, 503, 504, 505],  # 9 blocks by hash, 2 slots copied (a tail hit)
]
TINY_ARGS = dict(
    dtype="float32", block_size=4, num_blocks=128, max_num_batched_tokens=16, enable_prefix_caching=True, num_threads=1
)


def _generate(llm: LLM, prompts, new=NEW):
    params = SamplingParams(temperature=0, max_tokens=new, logprobs=0)
    # The first prompt alone, then the rest: the shared prefix is cached by the time it repeats.
    outs = llm.generate([{"prompt_token_ids": prompts[0]}] + [{"prompt_token_ids": prompts[3]}], params, use_tqdm=False)
    rest = [p for i, p in enumerate(prompts) if i not in (0, 3)]
    outs += llm.generate([{"prompt_token_ids": p} for p in rest], params, use_tqdm=False)
    order = [0, 3] + [i for i in range(len(prompts)) if i not in (0, 3)]
    got = [None] * len(prompts)
    for i, o in zip(order, outs):
        got[i] = (o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
    return got


def _assert_same(got, expected, tol=1e-3):
    for k, ((ids, lps), (exp_ids, exp_lps)) in enumerate(zip(got, expected)):
        assert ids == exp_ids, f"prompt {k}: {ids} != {exp_ids}"
        assert max(abs(a - b) for a, b in zip(lps, exp_lps)) < tol, f"prompt {k}: logprobs differ"


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama_dir):
    return hf_greedy(tiny_llama_dir, PROMPTS, NEW)


@pytest.fixture(scope="module")
def tiny_tp1(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), **TINY_ARGS)
    yield llm
    llm.shutdown()


def test_tiny_tp2_matches_tp1_and_transformers(ray_local, tiny_llama_dir, tiny_reference, tiny_tp1):
    tp1 = _generate(tiny_tp1, PROMPTS)
    _assert_same(tp1, tiny_reference)
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **TINY_ARGS)
    try:
        ex = llm.engine.core.executor
        got = _generate(llm, PROMPTS)
        assert [g[0] for g in got] == [t[0] for t in tp1]
        _assert_same(got, tiny_reference)
        stats = llm.stats()
        assert stats["blocks_used"] == 0
        # Prompt 5 only: 9 full blocks of SHARED, then 2 slots of prompt 3's 10th block copied on both ranks.
        assert stats["prefix_cache_hits"] == 38
        llm.engine.core.scheduler.check_integrity()
        ex.check_health()

        # Prompt logprobs over a chunked prompt, and seeded sampling, agree with tp=1.
        sp = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=8, prompt_logprobs=0)
        a, b = (x.generate({"prompt_token_ids": PROMPTS[4]}, sp, use_tqdm=False)[0] for x in (tiny_tp1, llm))
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        pa, pb = ([lp.logprob for lp in o.prompt_logprobs[1:]] for o in (a, b))
        assert len(pb) == len(PROMPTS[4]) - 1 and max(abs(x - y) for x, y in zip(pa, pb)) < 1e-4
        # The watermark's green lists come from the previous token alone: tp=2 samples the same.
        wm = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, watermark=Watermark(key=99))
        a, b = (x.generate({"prompt_token_ids": PROMPTS[1]}, wm, use_tqdm=False)[0] for x in (tiny_tp1, llm))
        plain = tiny_tp1.generate(
            {"prompt_token_ids": PROMPTS[1]}, dataclasses.replace(wm, watermark=None), use_tqdm=False
        )
        assert a.outputs[0].token_ids == b.outputs[0].token_ids != plain[0].outputs[0].token_ids

        # Shards: parameters ~1/tp per rank, KV cache holds kv_heads/tp heads per rank.
        info = ex.worker_info()
        full = parameter_bytes(tiny_tp1.engine.core.executor.runner.model)
        assert [i["rank"] for i in info] == [0, 1] and info[0]["pid"] == os.getpid() != info[1]["pid"]
        assert len({i["node_id"] for i in info}) == 1
        local = ex.rank0.runner  # rank 0's shard lives in this process
        assert abs(parameter_bytes(local.model) - full / 2) / full < 0.02
        assert local.num_kv_heads_local == 2 and tuple(local.kv_caches[0].shape) == (2, 2, ex.num_blocks, 4, 8)
        for i in info:
            assert abs(i["param_bytes"] - full / 2) / full < 0.02, (i["param_bytes"], full)
            assert i["num_kv_heads"] == 2 and i["kv_cache_shape"] == (2, 2, ex.num_blocks, 4, 8)
            assert i["num_threads"] == 1
        assert ex.kv_bytes_per_block() * 2 == tiny_tp1.engine.core.executor.kv_bytes_per_block()
    finally:
        llm.shutdown()


def test_mqa_kv_head_replicated_over_ranks(ray_local, tiny_mqa_dir):
    """1 KV head, tp=2: each rank keeps a copy of it (and half the query heads)."""
    expected = hf_greedy(tiny_mqa_dir, PROMPTS[:3], NEW)
    llm = LLM(str(tiny_mqa_dir), tensor_parallel_size=2, **TINY_ARGS)
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False)
        _assert_same([(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs], expected)
        assert [i["num_kv_heads"] for i in llm.engine.core.executor.worker_info()] == [1, 1]
    finally:
        llm.shutdown()


def test_preemption_at_tp2(ray_local, tiny_llama_dir, tiny_reference):
    """A pool too small for the batch: requests are preempted and recomputed on every rank."""
    args = {**TINY_ARGS, "num_blocks": 24}
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **args)
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        got = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
        _assert_same(got, tiny_reference)
        assert llm.stats()["num_preemptions"] > 0
    finally:
        llm.shutdown()


def test_biases_and_tied_padded_vocab_at_tp2(ray_local, tiny_biased_dir):
    """Row-parallel bias added once, column biases sharded, tied head over a vocab (509) that
    does not divide by tp (the last shard is padded and the padding cut from the logits)."""
    prompts = [[1, 2, 3, 508, 507], list(range(200, 230))]
    expected = hf_greedy(tiny_biased_dir, prompts, NEW)
    llm = LLM(str(tiny_biased_dir), tensor_parallel_size=2, **TINY_ARGS)
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        _assert_same([(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs], expected)
    finally:
        llm.shutdown()


def test_tp_that_does_not_divide_the_model_is_refused(tiny_llama_dir):
    # 8 heads over 3 ranks: refused in the driver, before any Ray actor starts.
    with pytest.raises(InvalidRequestError, match="8 attention heads are not divisible by 3"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=3, **TINY_ARGS)


def test_kv_head_replication_rules():
    from types import SimpleNamespace

    from workers.sharding import check_tp_compatible, kv_heads_per_rank

    cfg = lambda h, kv: SimpleNamespace(num_attention_heads=h, num_key_value_heads=kv, intermediate_size=1536)
    check_tp_compatible(cfg(8, 2), 4)
    assert kv_heads_per_rank(cfg(8, 2), 4) == 1 and kv_heads_per_rank(cfg(8, 4), 2) == 2
    with pytest.raises(InvalidRequestError, match="cannot replicate 3 KV heads"):
        check_tp_compatible(cfg(12, 3), 4)
    with pytest.raises(InvalidRequestError, match="6 KV heads are not divisible by 4"):
        check_tp_compatible(cfg(12, 6), 4)


SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "The capital of France is a city where",  # shares its first block with the first prompt
]


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1_and_transformers(ray_local, smollm_dir, smollm_tokenizer, hf_smollm):
    ids = [smollm_tokenizer(p).input_ids for p in SMOL_PROMPTS]
    new = 16
    expected = hf_greedy(smollm_dir, ids, new, hf_model=hf_smollm, eos_token_id=smollm_tokenizer.eos_token_id)
    args = dict(
        dtype="float32",
        block_size=4,
        kv_cache_memory_bytes=16 << 20,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
        num_threads=1,
    )
    params = SamplingParams(temperature=0, max_tokens=new, logprobs=0)

    def run(llm):
        outs = llm.generate({"prompt_token_ids": ids[0]}, params, use_tqdm=False)
        outs += llm.generate([{"prompt_token_ids": x} for x in ids[1:]], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]

    tp1 = LLM(**args)
    try:
        got1 = run(tp1)
        full = parameter_bytes(tp1.engine.core.executor.runner.model)
    finally:
        tp1.shutdown()
    _assert_same(got1, expected)
    llm = LLM(tensor_parallel_size=3, **args)
    try:
        got3 = run(llm)
        info = llm.engine.core.executor.worker_info()
        assert [i["rank"] for i in info] == [0, 1, 2] and info[0]["pid"] == os.getpid()
        assert llm.stats()["blocks_used"] == 0
    finally:
        llm.shutdown()
    assert [g[0] for g in got3] == [g[0] for g in got1]
    _assert_same(got3, expected)
    for i in info:
        assert i["num_kv_heads"] == 1 and i["kv_cache_shape"][1] == 1
        assert abs(i["param_bytes"] - full / 3) / full < 0.02, (i["param_bytes"], full)
