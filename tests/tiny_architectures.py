"""Tiny random Qwen3, Phi-3, Gemma 2 and Gemma 3 checkpoints saved as real HF directories (2 layers, width 64,
4 heads over 2 KV heads, vocab 512), shared by the engine and tensor-parallel tests."""

from __future__ import annotations

import shutil

import torch

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,  # wider than the default: greedy tokens vary with the context
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# Gemma 3: one sliding and one full layer with RoPE bases and scaling of their own (given as a
# hub config gives them), a score scale that is not head_dim's, tied embeddings, and a window
# (which caps max_model_len) longer than any test sequence.
GEMMA3 = dict(
    TINY,
    head_dim=32,
    query_pre_attn_scalar=24,
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=128,
    rope_theta=10000.0,
    rope_local_base_freq=100.0,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
    tie_word_embeddings=True,
    architectures=["Gemma3ForCausalLM"],
)


# Gemma 2: Gemma 3's layout without q/k norms or per-type RoPE bases; soft-caps as the test sets.
GEMMA2 = dict(
    TINY,
    head_dim=32,
    query_pre_attn_scalar=24,
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=128,
    tie_word_embeddings=True,
    architectures=["Gemma2ForCausalLM"],
)


def tiny_config(kind: str, **overrides):
    """qwen3: head_dim 32 from the config (not hidden/heads = 16), q/k norms; phi3: fused
    checkpoint tensors, half of each head rotated; gemma3 and gemma2: as GEMMA3 and GEMMA2 say."""
    from transformers import Phi3Config, Qwen3Config

    if kind == "qwen3":
        return Qwen3Config(**{**TINY, "head_dim": 32, **overrides})
    if kind == "phi3":
        return Phi3Config(**{**TINY, "partial_rotary_factor": 0.5, **overrides})
    if kind == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(**{**GEMMA3, **overrides})
    if kind == "gemma2":
        from transformers import Gemma2Config

        return Gemma2Config(**{**GEMMA2, **overrides})
    raise ValueError(kind)


def save_tiny(kind: str, path, tokenizer_from=None, seed: int = 0, **overrides):
    """A random model of `kind` saved with save_pretrained; returns the float32 HF model. Norm
    weights (transformers: ones) are drawn around 1 so the q/k norms' scales count."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **overrides)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer_from is not None:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if (tokenizer_from / f).exists():
                shutil.copy(tokenizer_from / f, path / f)
    return model
