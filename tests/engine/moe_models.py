"""Tiny random mixture-of-experts checkpoints (Mixtral, Qwen2-MoE with a shared expert and a
dense layer) saved by transformers, for the engine's and the tensor-parallel tests."""

from __future__ import annotations

import torch

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def save_moe(kind: str, path, tokenizer_from=None, seed: int = 0):
    """kind: "mixtral" (4 experts, top 2), "qwen2_moe" (5 experts, top 2, a shared expert,
    layer 1 dense, top-k weights not renormalized), "qwen2_moe_norm" (renormalized) or
    "qwen3_moe" (per-head q/k norms, 6 experts, top 3, renormalized)."""
    import shutil

    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2))
    elif kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(**COMMON, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48, head_dim=32)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        cfg = Qwen2MoeConfig(
            **COMMON,
            num_experts=5,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            mlp_only_layers=[1],
            norm_topk_prob=kind == "qwen2_moe_norm",
        )
        model = Qwen2MoeForCausalLM(cfg)
        with torch.no_grad():  # transformers leaves QKV biases at zero: make them count
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.2)
    model.float().eval().save_pretrained(path, safe_serialization=True)
    if tokenizer_from is not None:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / f, path / f)
    return model
