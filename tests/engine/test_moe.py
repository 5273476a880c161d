"""Mixture-of-experts models (engine/layers/moe.py): tiny random Mixtral, Qwen2-MoE (shared
expert, a dense layer, with and without renormalized top-k weights) and Qwen3-MoE give transformers' float32
greedy tokens and logprobs, through chunked prefill, prefix-cache hits and preemption; their
experts quantize like any linear."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy
from tests.engine.moe_models import save_moe

PROMPTS = [[5, 17, 300, 201, 77], [100 + i for i in range(40)], [42] * 3, list(range(7, 7 + 90, 3))]
SHARED = [[100 + i for i in range(40)] + [7, 8, 9]]  # a prefix-cache hit on the second prompt


def _run(path, prompts, **kw):
    args = dict(dtype="float32", block_size=8, max_num_batched_tokens=24, num_threads=2, enable_prefix_caching=True)
    llm = LLM(str(path), **{**args, **kw})
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=16, logprobs=0),
            use_tqdm=False,
        )
        stats = llm.stats()
        assert stats["blocks_used"] == 0
        return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs], stats
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen2_moe_norm", "qwen3_moe"])
def test_moe_model_matches_transformers(kind, tmp_path, smollm_dir):
    hf = save_moe(kind, tmp_path, smollm_dir)
    prompts = PROMPTS + SHARED
    expected = [hf_greedy(hf, p, 16, None) for p in prompts]
    # 18 blocks of 8 cannot hold the five sequences at once: some are preempted and recomputed.
    got, stats = _run(tmp_path, prompts, num_blocks=18)
    for k, ((ids, lps), (exp_ids, exp_lps)) in enumerate(zip(got, expected)):
        assert ids == exp_ids, f"prompt {k}"
        assert max(abs(a - b) for a, b in zip(lps, exp_lps)) < 1e-3, f"prompt {k}"
    print(kind, {k: v for k, v in stats.items() if "preempt" in k or "prefix" in k})


def test_moe_experts_quantize(tmp_path, smollm_dir):
    """int8 experts (the router stays float): logprobs near the float model's."""
    save_moe("qwen2_moe", tmp_path, smollm_dir)
    ref, _ = _run(tmp_path, PROMPTS, num_blocks=64)
    got, _ = _run(tmp_path, PROMPTS, num_blocks=64, quantization="int8")
    first = [abs(g[1][0] - r[1][0]) for g, r in zip(got, ref)]  # the first token: same context
    assert max(first) < 0.1, first


def test_every_expert_weighted_equals_the_chosen_experts(tmp_path, smollm_dir):
    """The form a CUDA graph captures (every expert over every token, zero weight where not
    chosen) sums what the chosen experts' form sums: float32 rounding of a sum in another order."""
    import torch

    from engine.layers.moe import SparseMoE

    save_moe("qwen3_moe", tmp_path, smollm_dir)
    llm = LLM(str(tmp_path), dtype="float32", num_threads=2, num_blocks=8)
    try:
        moe = next(m for m in llm.engine.core.executor.runner.model.modules() if isinstance(m, SparseMoE))
        x = torch.randn(37, 64)
        weights, chosen = torch.topk(torch.softmax(torch.randn(37, moe.num_experts), -1), moe.top_k, dim=-1)
        sparse, dense = moe._chosen_experts(x, weights, chosen), moe._every_expert(x, weights, chosen)
        assert len(torch.unique(chosen)) == moe.num_experts  # every expert has tokens here
        # The same dot products (hidden 64, then moe_intermediate 48), maybe through other kernels
        # for other row counts: each form is within gamma_n = n * eps of exact, n = 64 + 48 + top_k
        # (the weighted sum); twice that, relative to the layer's output scale, bounds their gap.
        tol = 2 * (64 + 48 + moe.top_k) * torch.finfo(torch.float32).eps
        torch.testing.assert_close(dense, sparse, rtol=tol, atol=tol * sparse.abs().max().item())
        moe_zero = moe._every_expert(x, torch.zeros_like(weights), chosen)
        assert torch.count_nonzero(moe_zero) == 0
    finally:
        llm.shutdown()
