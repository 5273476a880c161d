"""Mixture-of-experts under tensor parallelism (expert parallelism: whole experts per rank, the
shares summed by the all-reduce): tp=2 gives transformers' float32 greedy tokens and logprobs."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.engine.hf_reference import hf_greedy
from tests.engine.moe_models import save_moe
from workers import LLM

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 300, 201, 77], [100 + i for i in range(40)], list(range(7, 7 + 60, 3))]


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_at_tp2_matches_transformers(kind, tmp_path, smollm_dir, ray_local):
    hf = save_moe(kind, tmp_path, smollm_dir)
    expected = [hf_greedy(hf, p, 12, None) for p in PROMPTS]
    llm = LLM(
        str(tmp_path), tensor_parallel_size=2, dtype="float32", block_size=8, num_blocks=64, max_num_batched_tokens=24,
        enable_prefix_caching=True, num_threads=1,
    )  # fmt: skip
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(temperature=0, max_tokens=12, logprobs=0),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    for k, (out, (ids, lps)) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == ids, f"prompt {k}"
        got = [lp.logprob for lp in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-3, f"prompt {k}"
