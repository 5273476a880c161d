"""Qwen3, Phi-3 and Gemma 3 at tensor parallel 2 (rank 0 in the driver, rank 1 a Ray actor): transformers'
greedy tokens and logprobs in float32. Phi-3's fused qkv_proj and gate_up_proj are cut into
their parts before sharding: each rank keeps its own q, k and v heads and its gate and up rows.
Gemma 3's per-head q/k norms and its four (1 + weight) norms are replicated on each rank."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.tiny_architectures import save_tiny
from tests.workers.conftest import hf_greedy
from workers import LLM

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

NEW = 12
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [100, 200, 300], list(range(300, 350))]


@pytest.mark.parametrize("kind", ["qwen3", "phi3", "gemma3"])
def test_tp2_matches_transformers(ray_local, kind, tmp_path, smollm_dir):
    hf = save_tiny(kind, tmp_path, tokenizer_from=smollm_dir)
    expected = hf_greedy(tmp_path, PROMPTS, NEW, hf_model=hf)
    llm = LLM(
        str(tmp_path),
        tensor_parallel_size=2,
        dtype="float32",
        block_size=4,
        num_blocks=128,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        num_threads=1,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [i["num_kv_heads"] for i in llm.engine.core.executor.worker_info()] == [1, 1]
    finally:
        llm.shutdown()
    for k, (out, (ids, lps)) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == ids, f"prompt {k}"
        got = [lp.logprob for lp in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-3, f"prompt {k}"
