"""Tiny random Qwen3 and Phi-3 checkpoints saved as real HF directories (2 layers, width 64,
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


def tiny_config(kind: str, **overrides):
    """qwen3: head_dim 32 from the config (not hidden/heads = 16), q/k norms; phi3: fused
    checkpoint tensors, half of each head rotated."""
    from transformers import Phi3Config, Qwen3Config

    if kind == "qwen3":
        return Qwen3Config(**{**TINY, "head_dim": 32, **overrides})
    if kind == "phi3":
        return Phi3Config(**{**TINY, "partial_rotary_factor": 0.5, **overrides})
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
