"""Gemma 3 text in the engine's own decoder (engine/model/gemma.py): a tiny random checkpoint
(tests/tiny_architectures.py GEMMA3: a sliding and a full layer with RoPE of their own,
query_pre_attn_scalar != head_dim, tied embeddings) gives transformers' greedy tokens and
logprobs in float32 through prefix hits, chunked prompts and preemption, and with int8 weights
agrees with the same weights dequantized. Every sequence stays shorter than the window, where
transformers' sliding layers attend to everything, as the engine's do. Gemma 2 and soft-capped
Gemma 3 configs are refused by the field the engine lacks. Tensor parallel:
tests/workers/test_architectures_tp.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.layers.rotary import rope_parameters
from engine.model.config_check import check_model_config, sliding_window_of
from engine.model.fused_decode import FusedDecode
from engine.model.llama import LlamaForCausalLM
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_architectures import NEW, PROMPTS, _assert_matches
from tests.tiny_architectures import GEMMA3, save_tiny, tiny_config

WINDOW = GEMMA3["sliding_window"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_dir):
    path = tmp_path_factory.mktemp("gemma3")
    hf = save_tiny("gemma3", path, tokenizer_from=smollm_dir)
    assert max(len(p) for p in PROMPTS) + NEW < WINDOW
    return path, [hf_greedy(hf, p, NEW, None) for p in PROMPTS]


def test_gemma3_matches_transformers_with_prefix_hits_chunks_and_preemption(tiny):
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
        ("gemma2", {}, "attn_logit_softcapping"),
        ("gemma3", dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
        ("gemma3", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
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


def test_gemma2_refused_in_the_driver(tmp_path, smollm_dir):
    tiny_config("gemma2").save_pretrained(tmp_path)
    with pytest.raises(InvalidRequestError, match="attn_logit_softcapping"):
        LLM(str(tmp_path), dtype="float32", num_blocks=16, num_threads=1)
