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


# A model that thinks out loud: the chat stand-in's tokenizer with `<think>`, `</think>`,
# `<tool_call>` and `</tool_call>` as single added (not special) tokens, as Qwen3's tokenizer has
# them, and a 1-layer Llama whose greedy next token depends only on the last token (attention and
# MLP write nothing; each chain token's embedding is its own basis vector and lm_head maps it to
# the next one). After the generation prompt's "\n" it writes THINKING_OUTPUT and ends on EOS;
# after "</think>" (a prompt that closes the block: enable_thinking false) just the answer; after
# "Wait" (a continued assistant message) a hermes tool call, then closes the block and answers.
THINKING_CHAINS = (
    ("\n", "<think>", "The", " user", " asks", "</think>", "Hello", "!", "<|im_end|>"),
    ("Wait", "<tool_call>", '{"', "name", '":"', "f", '","', "arguments", '":', "{}", "}", "</tool_call>", "</think>"),
)
THINKING_OUTPUT = "<think>The user asks</think>Hello!"
_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
_THINKING_TEMPLATE_END = (
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>' }}{% endif %}"
    "{% endif %}"
)


def save_thinking_stand_in(path, tokenizer_from):
    from transformers import AddedToken, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    tok.add_tokens([AddedToken(t, special=False) for t in _TAGS])
    head, sep, _ = tok.chat_template.rpartition("{% if add_generation_prompt %}")
    assert sep, "the chat template's generation prompt moved"
    tok.chat_template = head + _THINKING_TEMPLATE_END

    def token_id(text: str) -> int:
        ids = tok(text, add_special_tokens=False).input_ids
        assert len(ids) == 1, (text, ids)
        return ids[0]

    chains = [[token_id(t) for t in chain] for chain in THINKING_CHAINS]
    pairs = dict(pair for chain in chains for pair in zip(chain, chain[1:]))
    assert len(pairs) == sum(len(c) - 1 for c in chains), "a token has two successors"
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        for k, (a, b) in enumerate(pairs.items()):
            model.model.embed_tokens.weight[a, k] = 1.0
            model.lm_head.weight[b, k] = 10.0
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
