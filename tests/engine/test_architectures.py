"""Qwen3 and Phi-3 in the engine's own decoder: tiny random checkpoints saved by the test give
transformers' greedy tokens and logprobs in float32, through prefix cache hits, chunked prompts
and preemption; Qwen3 with int8 weights agrees with the same weights dequantized; config fields
the engine does not implement are refused by name. Tensor parallel: tests/workers/test_architectures_tp.py."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.model.config_check import check_model_config
from tests.engine.hf_reference import hf_greedy
from tests.engine.path_agreement import assert_paths_agree, rounding_bound
from tests.tiny_architectures import save_tiny, tiny_config

NEW = 12
SHARED = list(range(40, 80))  # 10 blocks of 4: the later prompts hit the prefix cache
PROMPTS = [
    SHARED + [11, 12, 13],
    [100, 200, 300, 400, 5],
    list(range(300, 350)),  # several chunks of 16 tokens
    SHARED[:38] + [500, 501, 502, 503, 504, 505],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
]
# transformers' own test of these models against the engine: float32 on both sides, summed in
# other orders (SDPA against the paged kernels, fused q/k/v): logprobs move by float32 rounding
# of logits of size ~10, a few 1e-6 per op over two layers; 1e-3 as test_tiny_models.py.
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module", params=["qwen3", "phi3"])
def tiny(request, tmp_path_factory, smollm_dir):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, path, tokenizer_from=smollm_dir)
    return path, [hf_greedy(hf, p, NEW, None) for p in PROMPTS]


def _assert_matches(outs, expected):
    for k, (out, (ids, lps)) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == ids, f"prompt {k}"
        got = [lp.logprob for lp in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(got, lps)) < LOGPROB_TOL, f"prompt {k}"


def test_matches_transformers_with_prefix_hits_chunks_and_preemption(tiny):
    """The first prompt alone (its blocks stay cached), then all five on a pool too small for
    them: prefix hits, 16-token prompt chunks, preemption and recompute, each as transformers."""
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
    params = SamplingParams(temperature=0, max_tokens=NEW, logprobs=0, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)
    _assert_matches(first, expected[:1])
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    _assert_matches(outs, expected)
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats
    assert stats["blocks_used"] == 0
    llm.engine.core.scheduler.check_integrity()
    llm.shutdown()


def _dequantized_int8_copy(path, out, tokenizer_from):
    """The checkpoint at `path` with every weight the engine quantizes to int8 (the linears and
    the head; quant/apply.py) replaced by its int8 values times their scales (a tied head untied:
    its embedding stays float, as the engine's does)."""
    from transformers import AutoModelForCausalLM

    from engine.layers.quant.int8 import quantize_int8

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if model.config.tie_word_embeddings:
        # The engine quantizes a tied head's copy and looks the embedding up in float: untied here.
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear):
                q = quantize_int8(m.weight)  # per output row: the fused q/k/v rows quantize alike
                m.weight.copy_(q.float() * q.scale[:, None])
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / f, out / f)


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_int8_agrees_with_its_dequantized_weights(kind, tmp_path, smollm_dir):
    """int8 weights against a float32 engine over the same values dequantized: what is left is
    the int8 kernel's bf16 activations (at few rows on CPUs without the int4 op), bounded by the
    dequantized model run in bfloat16 against float32 (tests/engine/path_agreement.py). Gemma 3's
    head is tied: the engine quantizes a copy of it and looks the embedding up in float, as the
    untied dequantized checkpoint does."""
    qdir, fdir = tmp_path / "q", tmp_path / "f"
    save_tiny(kind, qdir, tokenizer_from=smollm_dir)
    _dequantized_int8_copy(qdir, fdir, smollm_dir)
    params = SamplingParams(temperature=0, max_tokens=NEW, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def run(path, **kw):
        llm = LLM(str(path), num_threads=2, block_size=4, num_blocks=128, max_num_batched_tokens=16, **kw)
        try:
            return llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.shutdown()

    exact = run(fdir, dtype="float32")
    bound = rounding_bound(run(fdir, dtype="bfloat16"), exact)
    got = run(qdir, dtype="float32", quantization="int8")
    print(f"bound {bound:.2e}")
    assert_paths_agree(got, exact, bound)


@pytest.mark.parametrize(
    "kind,overrides,field",
    [
        ("phi3", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling"),
        ("phi3", dict(partial_rotary_factor=0.1), "partial_rotary_factor"),
        ("qwen3", dict(hidden_act="gelu"), "hidden_act"),
        ("qwen3", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        ("qwen3", dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
        ("qwen3", dict(layer_types=["chunked_attention", "full_attention"]), "layer_types"),
    ],
)
def test_unimplemented_config_fields_are_refused_by_name(kind, overrides, field):
    cfg = tiny_config(kind)
    for k, v in overrides.items():  # set after construction: transformers validates some of these itself
        setattr(cfg, k, v)
    if "rope_scaling" in overrides:
        cfg.rope_parameters = dict(overrides["rope_scaling"], rope_theta=10000.0)
    if "partial_rotary_factor" in overrides:
        cfg.rope_parameters = dict(cfg.rope_parameters, partial_rotary_factor=overrides["partial_rotary_factor"])
    with pytest.raises(ValueError, match=field):
        check_model_config(cfg)


def test_llama_family_fields_are_checked():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, hidden_act="gelu_pytorch_tanh")
    with pytest.raises(ValueError, match="hidden_act"):
        check_model_config(cfg)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4)
    cfg.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="rope_scaling"):
        check_model_config(cfg)
    cfg.architectures = ["GemmaForCausalLM"]  # Gemma 1: not implemented
    with pytest.raises(ValueError, match="architectures"):
        check_model_config(cfg)


def test_refused_in_the_driver_before_loading(tmp_path, smollm_dir):
    save_tiny("qwen3", tmp_path, tokenizer_from=smollm_dir, hidden_act="gelu")
    with pytest.raises(InvalidRequestError, match="hidden_act='gelu'"):
        LLM(str(tmp_path), dtype="float32", num_blocks=16, num_threads=1)
