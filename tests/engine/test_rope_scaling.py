"""YaRN and LongRoPE position scaling (engine/layers/rotary.py): tiny random Llama and Qwen3 with
YaRN and Phi-3 with LongRoPE give transformers' float32 greedy tokens and logprobs, through
prefix-cache hits, chunked prompts and preemption; LongRoPE's long factors take over from
`original_max_position_embeddings` on, with transformers' cos/sin there; types not implemented
are refused by name."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_architectures import LOGPROB_TOL, NEW, PROMPTS
from tests.tiny_architectures import save_tiny, tiny_config

# Phi-3's rotary width is 8 here (head_dim 16, half rotated): 4 factors per set.
LONGROPE = dict(
    rope_scaling={"type": "longrope", "long_factor": [1.0, 2.0, 6.0, 12.0], "short_factor": [1.0, 1.2, 1.5, 2.0]},
    original_max_position_embeddings=128,
    max_position_embeddings=512,
)
YARN = dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
CASES = {
    "llama-yarn": ("llama", YARN),
    "qwen3-yarn": ("qwen3", YARN),
    "phi3-longrope": ("phi3", LONGROPE),
}


def _save(kind: str, path, tokenizer_from, overrides: dict):
    if kind == "llama":
        from transformers import AutoModelForCausalLM

        from tests.tiny_llama import save_tiny_llama

        save_tiny_llama(path, tokenizer_from=tokenizer_from, initializer_range=0.3, **overrides)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return save_tiny(kind, path, tokenizer_from=tokenizer_from, **overrides)


@pytest.mark.parametrize("case", list(CASES))
def test_scaled_rope_matches_transformers(case, tmp_path, smollm_dir):
    """Every sequence stays within LongRoPE's original length, where transformers uses the short
    factors throughout (the per-position rule and its per-forward rule agree there)."""
    kind, overrides = CASES[case]
    hf = _save(kind, tmp_path, smollm_dir, overrides)
    assert rope_parameters(hf.config)["rope_type"] == case.split("-")[1]
    expected = [hf_greedy(hf, p, NEW, None) for p in PROMPTS]
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_blocks=24, max_num_batched_tokens=16, num_threads=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW, logprobs=0, ignore_eos=True)
        llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)  # its blocks stay cached
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for k, (out, (ids, lps)) in enumerate(zip(outs, expected)):
            assert out.outputs[0].token_ids == ids, f"{case}: prompt {k}"
            got = [lp.logprob for lp in out.outputs[0].logprobs]
            assert max(abs(a - b) for a, b in zip(got, lps)) < LOGPROB_TOL, f"{case}: prompt {k}"
        stats = llm.stats()
        assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0 and stats["blocks_used"] == 0, stats
    finally:
        llm.shutdown()


def test_longrope_tables_switch_to_the_long_factors_at_the_original_length():
    """Positions below original_max_position_embeddings carry transformers' short-factor cos/sin,
    positions from it on its long-factor ones (what transformers computes for a sequence that
    long), both times the attention factor: bit for bit, the same float32 products."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = tiny_config("phi3", **LONGROPE)
    ours = RotaryEmbedding(16, 512, rope_parameters(config), torch.float32, config)
    hf = Phi3RotaryEmbedding(config)
    x = torch.zeros(1, 1, 16)
    near = torch.arange(0, 128)[None]
    far = torch.arange(0, 512)[None]  # a forward past 128 positions: transformers takes the long set
    cos_short, sin_short = hf(x, near)
    cos_long, sin_long = hf(x, far)
    assert torch.equal(ours.cos[:128], cos_short[0]) and torch.equal(ours.sin[:128], sin_short[0])
    assert torch.equal(ours.cos[128:], cos_long[0, 128:]) and torch.equal(ours.sin[128:], sin_long[0, 128:])
    assert not torch.equal(cos_short[0], cos_long[0, :128])  # the two sets differ: the test can tell


@pytest.mark.parametrize(
    "scaling", [{"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "proportional", "factor": 2.0}]
)
def test_rope_types_not_implemented_are_refused(scaling):
    from transformers import LlamaConfig

    from engine.model.config_check import _check_rope

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_scaling=scaling)
    with pytest.raises(ValueError, match=scaling["rope_type"]):
        _check_rope(rope_parameters(config), 16)
