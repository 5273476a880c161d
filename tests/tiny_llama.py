"""Tiny random Llamas saved as real HF directories, shared by the test layers that need a second
model (tensor-parallel checks, a draft model, a router pool)."""

from __future__ import annotations

import shutil

import torch

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
)


def save_tiny_llama(path, seed: int = 0, tokenizer_from=None, **overrides):
    """A random Llama saved with save_pretrained(safe_serialization=True). No EOS: generation
    runs to max_tokens on both sides. LLMEngine loads a tokenizer from the model directory, so
    the embedded model's tokenizer is copied in (prompts are token ids; ids < 512 decode fine)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY, **overrides}, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # transformers initialises biases to zero: make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer_from is not None:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / f, path / f)
    return path
