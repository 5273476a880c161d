"""Gemma 2 and Gemma 3 text in the engine's own decoder (engine/model/gemma.py): tiny random
checkpoints (tests/tiny_architectures.py GEMMA3: a sliding and a full layer with RoPE of their
own, query_pre_attn_scalar != head_dim, tied embeddings; Gemma 2 with soft-caps small enough
that tanh bends the scores and logits) give transformers' greedy tokens and logprobs in float32
through prefix hits, chunked prompts and preemption, and with int8 weights agree with the same
weights dequantized. Every sequence stays shorter than the window, where transformers' sliding
layers attend to everything, as the engine's do. Fields the engine lacks are refused by name.
Tensor parallel: tests/workers/test_architectures_tp.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine import LLM, SamplingParams
from engine.layers.rotary import rope_parameters
from engine.model.config_check import check_model_config, sliding_window_of
from engine.model.fused_decode import FusedDecode
from engine.model.llama import LlamaForCausalLM
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_architectures import NEW, PROMPTS, _assert_matches
from tests.tiny_architectures import GEMMA3, save_tiny, tiny_config

WINDOW = GEMMA3["sliding_window"]


# Scores of this tiny model reach a few units and logits ~10: caps this small bend both.
GEMMA2_CAPS = dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def tiny(request, tmp_path_factory, smollm_dir):
    path = tmp_path_factory.mktemp(request.param)
    overrides = GEMMA2_CAPS if request.param == "gemma2" else {}
    hf = save_tiny(request.param, path, tokenizer_from=smollm_dir, **overrides)
    assert max(len(p) for p in PROMPTS) + NEW < WINDOW
    return path, [hf_greedy(hf, p, NEW, None) for p in PROMPTS]


def test_gemma_matches_transformers_with_prefix_hits_chunks_and_preemption(tiny):
    path, expected = tiny
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=4,
        num_blocks=24,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        num_threads=2,
    )
    try:
        assert llm.engine.model_config.max_model_len == WINDOW  # capped: no backend has a window
        params = SamplingParams(temperature=0, max_tokens=NEW, logprobs=0, ignore_eos=True)
        first = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)
        _assert_matches(first, expected[:1])
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        _assert_matches(outs, expected)
        stats = llm.stats()
        assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats
        assert stats["blocks_used"] == 0
        llm.engine.core.scheduler.check_integrity()
    finally:
        llm.shutdown()


def test_gemma3_layers_take_their_own_rope_and_scale():
    cfg = tiny_config("gemma3")
    full, sliding = rope_parameters(cfg, "full_attention"), rope_parameters(cfg, "sliding_attention")
    assert (full["rope_type"], full["factor"], full["rope_theta"]) == ("linear", 2.0, 10000.0)
    assert (sliding["rope_type"], sliding["rope_theta"]) == ("default", 100.0)
    # transformers 4.x keeps them flat: rope_local_base_freq for sliding layers, which go unscaled
    flat = SimpleNamespace(
        rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0}
    )
    assert rope_parameters(flat, "sliding_attention")["rope_type"] == "default"
    assert rope_parameters(flat, "sliding_attention")["rope_theta"] == 1e4
    assert rope_parameters(flat, "full_attention")["factor"] == 8.0
    model = LlamaForCausalLM(cfg, max_position=WINDOW)
    layers = model.model.layers
    assert layers[0].self_attn.rotary is not layers[1].self_attn.rotary
    assert layers[0].self_attn.attn.scale == pytest.approx(24**-0.5)
    assert FusedDecode.for_model(model.model) is None


def test_any_sliding_layer_caps_at_the_window():
    assert sliding_window_of(tiny_config("gemma3")) == WINDOW
    assert sliding_window_of(tiny_config("gemma3", layer_types=["full_attention"] * 2)) == WINDOW  # as Mistral
    assert sliding_window_of(SimpleNamespace(sliding_window=64, use_sliding_window=False)) is None
    on = SimpleNamespace(sliding_window=64, use_sliding_window=False, layer_types=["sliding_attention"])
    assert sliding_window_of(on) == 64


@pytest.mark.parametrize(
    "kind,overrides,field",
    [
        ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        ("gemma3", dict(hidden_activation="gelu"), "hidden_activation"),
    ],
)
def test_gemma_fields_the_engine_lacks_are_refused_by_name(kind, overrides, field):
    cfg = tiny_config(kind)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    with pytest.raises(ValueError, match=field):
        check_model_config(cfg)


def test_gemma2_soft_caps_run_on_the_reference_backend(smollm_dir):
    """The scores' soft-cap lives in the reference backend's explicit scores (the C++ and Triton
    kernels have no such step): every layer takes it, with the config's cap; logits are capped."""
    import torch

    model = LlamaForCausalLM(tiny_config("gemma2", **GEMMA2_CAPS), max_position=WINDOW)
    backends = {layer.backend.name for layer in model.attention_layers()}
    assert backends == {"reference"} and model.attention_layers()[0].backend.softcap == 2.0
    hidden = torch.randn(5, 64) * 100
    assert model.compute_logits(hidden).abs().max() <= 3.0
