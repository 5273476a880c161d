"""Random tiny Qwen2 (QKV bias) and Llama checkpoints saved by the test, loaded by the engine,
compared with transformers in float32."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy

PROMPTS = [[5, 17, 300, 2048, 77], [1000 + i for i in range(40)], [42] * 3, list(range(7, 7 + 90, 3))]


def _save_tiny(kind: str, path, smollm_tokenizer, random_biases: bool = False, **overrides):
    """A random tiny checkpoint saved to `path`; `overrides` change the config (sizes),
    `random_biases` draws the biases (transformers leaves them zero)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = (
        dict(
            vocab_size=len(smollm_tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            initializer_range=0.3,
            eos_token_id=smollm_tokenizer.eos_token_id,
            tie_word_embeddings=False,
        )
        | overrides
    )
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=10000.0))
    else:
        model = LlamaForCausalLM(
            LlamaConfig(
                **common,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            )
        )
    model = model.float().eval()
    if random_biases:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    smollm_tokenizer.save_pretrained(path)
    return model


@pytest.mark.parametrize("kind", ["qwen2", "llama3"])
def test_tiny_model_matches_transformers(kind, tmp_path, smollm_tokenizer):
    hf = _save_tiny(kind, tmp_path, smollm_tokenizer)
    if kind == "qwen2":
        assert hf.model.layers[0].self_attn.q_proj.bias is not None
    eos = smollm_tokenizer.eos_token_id
    expected = [hf_greedy(hf, p, 16, eos) for p in PROMPTS]
    llm = LLM(str(tmp_path), dtype="float32", num_blocks=64, block_size=8, max_num_batched_tokens=24, num_threads=2)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=16, logprobs=0),
        use_tqdm=False,
    )
    for out, (ids, lps) in zip(outs, expected):
        assert out.outputs[0].token_ids == ids
        got = [lp.logprob for lp in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-3
