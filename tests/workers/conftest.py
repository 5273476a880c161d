"""Fixtures for tensor-parallel tests: Ray (the run's shared cluster), tiny random Llamas saved
as real HF directories, and transformers references."""

from __future__ import annotations

import pytest
import torch

from tests.serve_cluster import shared_ray
from tests.tiny_llama import save_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm_dir):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tokenizer_from=smollm_dir)


@pytest.fixture(scope="session")
def tiny_mqa_dir(tmp_path_factory, smollm_dir):
    """4 heads, 1 KV head: at tp=2 each rank must hold a replica of the single KV head."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny-mqa"),
        seed=1,
        tokenizer_from=smollm_dir,
        num_attention_heads=4,
        num_key_value_heads=1,
    )


@pytest.fixture(scope="module")
def ray_local():
    """Ray for a module's tests: the run's shared cluster (tests/serve_cluster.py), which the
    packages after this one keep using and the run's end shuts down."""
    import ray

    shared_ray()
    yield ray


@torch.inference_mode()
def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int, hf_model=None, eos_token_id=None):
    """transformers `generate`, greedy, one prompt at a time (no padding): ids and logprobs."""
    from transformers import AutoModelForCausalLM

    model = hf_model or AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        g = model.generate(
            torch.tensor([p]),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id or 0,
        )
        ids = g.sequences[0, len(p) :].tolist()
        lps = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(g.logits, ids)]
        out.append((ids, lps))
    return out


@pytest.fixture(scope="session")
def tiny_biased_dir(tmp_path_factory, smollm_dir):
    """Biases everywhere (column and row parallel; the row bias must be added once) and tied
    embeddings (the vocab-parallel embedding doubles as the LM head)."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny-biased"),
        seed=2,
        tokenizer_from=smollm_dir,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        vocab_size=509,
    )
