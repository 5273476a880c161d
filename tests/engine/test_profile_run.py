"""The dummy step that sizes the KV pool on CUDA runs on any device: checked here on CPU with a
token budget over the model's context (positions past it indexed outside the rotary table)."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams


def test_profile_run_longer_than_context_then_serves(tmp_path, smollm_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(smollm_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    smollm_tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", num_blocks=32, block_size=8, num_threads=1)
    runner = llm.engine.core.executor.runner
    runner.profile_run(150)  # 64 + 64 + 22 tokens
    assert runner.kv_caches == [] and all(a.kv_cache is None for a in runner.model.attention_layers())
    runner.init_kv_cache(llm.engine.core.executor.num_blocks)
    out = llm.generate(
        {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 3
