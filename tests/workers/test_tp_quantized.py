"""Quantized weights at tp=3 (SmolLM2: 9 heads, 3 KV heads): each rank quantizes (or decodes
from the GGUF) its own shards with their scales; int4 groups and GGUF blocks of 32 fall inside a
row-parallel shard (576 / 3 = 192, 1536 / 3 = 512 inputs), so every rank holds exactly tp=1's
values for its rows. Greedy outputs agree with tp=1's, with prefix-cache hits; weights ~1/3 per
rank. The int8 KV cache too: its scales are per KV head, so each rank's heads are exactly tp=1's.
The row-parallel all-reduce sums in another order than tp=1's GEMM, and the quantized paths
round intermediates (int4 activations to bf16 where the CPU has bf16 dot products, K/V to int8):
the bound is measured from a tp=1 run one format finer or coarser (tests/engine/path_agreement.py)."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.model.loader import parameter_bytes
from tests.engine.path_agreement import assert_paths_agree, rounding_bound
from workers import LLM

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "The capital of France is a city where"]
ARGS = dict(dtype="float32", block_size=4, kv_cache_memory_bytes=16 << 20, enable_prefix_caching=True, num_threads=1)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("quant", "rounding"),
    [
        ({"quantization": "int4:g32"}, {"dtype": "bfloat16"}),
        ({"quantization": "gguf"}, {"dtype": "bfloat16"}),
        ({"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "auto"}),
    ],
    ids=["int4:g32", "gguf", "kv-int8"],
)
def test_quantized_tp3_matches_tp1(ray_local, smollm_tokenizer, quant, rounding):
    ids = [{"prompt_token_ids": smollm_tokenizer(p).input_ids} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)

    def run(llm):
        outs = llm.generate(ids[0], params, use_tqdm=False)  # caches the prefix the third shares
        return outs + llm.generate(ids[1:], params, use_tqdm=False)

    tp1 = LLM(**quant, **ARGS)
    try:
        expected = run(tp1)
        full = parameter_bytes(tp1.engine.core.executor.runner.model)
    finally:
        tp1.shutdown()
    other = LLM(**(ARGS | quant | rounding))
    try:
        bound = rounding_bound(expected, run(other))
    finally:
        other.shutdown()
    llm = LLM(**quant, tensor_parallel_size=3, **ARGS)
    try:
        got = run(llm)
        stats, info = llm.stats(), llm.engine.core.executor.worker_info()
    finally:
        llm.shutdown()
    assert_paths_agree(got, expected, bound)
    assert stats["prefix_cache_hits"] > 0 and stats["blocks_used"] == 0, stats
    for i in info:
        assert abs(i["param_bytes"] - full / 3) / full < 0.05, (i["param_bytes"], full)
