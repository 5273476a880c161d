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
    """A random Llama saved with save_pretrained(safe_serialization=True). No EOS unless
    `overrides` name one: generation runs to max_tokens on both sides. LLMEngine loads a tokenizer from the model directory, so
    the embedded model's tokenizer is copied in (prompts are token ids; ids < 512 decode fine)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    ids = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg = LlamaConfig(**{**ids, **TINY, **overrides})
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # transformers initialises biases to zero: make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer_from is not None:
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (tokenizer_from / f).exists():
                shutil.copy(tokenizer_from / f, path / f)
    return path


# A stand-in for the embedded model in the tests of serving plumbing (failover, routing, P/D,
# autoscaling): its vocabulary, tokenizer and chat template, 2 layers of width 96. Weights drawn
# 10x wider than transformers' default make greedy tokens vary with the context (a resume that
# skips or repeats a token changes the text), and a token costs ~1/25 of SmolLM2-135M's.
CHAT_STAND_IN = dict(
    vocab_size=49152,
    hidden_size=96,  # 6 heads of 16, 3 KV heads: splits over 1 and 3 ranks like SmolLM2-135M
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    initializer_range=0.2,
    bos_token_id=1,  # SmolLM2's <|im_start|> and <|im_end|>: chat turns and grammars end on EOS
    eos_token_id=2,
)


def chat_stand_in_block_bytes(block_size: int = 16, dtype_bytes: int = 4) -> int:
    """KV bytes of one block of the stand-in (K and V of every layer): sizes a cache in blocks."""
    c = CHAT_STAND_IN
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * block_size * dtype_bytes


def save_chat_stand_in(path, tokenizer_from):
    return save_tiny_llama(path, seed=0, tokenizer_from=tokenizer_from, **CHAT_STAND_IN)
