"""GPTQ and AWQ checkpoints (engine/model/gptq_awq.py), made here from a tiny random Llama
(tests/engine/gptq_awq_writer.py): loaded onto the int4 kernels, their prompt logprobs stay within
rounding of the same weights dequantized in float, and greedy tokens agree wherever the float
model's top two are further apart than that rounding; act-order weights run with their inputs
reordered (or as float where their parts disagree); configs the engine does not implement are
refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from tests.engine.gptq_awq_writer import write_quantized
from tests.tiny_llama import save_tiny_llama

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

ARGS = dict(dtype="float32", num_threads=2, kv_cache_memory_bytes=32 << 20, max_model_len=256)
PROMPT = [(37 * i + 11) % 500 for i in range(48)]
SHAPE = dict(hidden_size=128, intermediate_size=256, initializer_range=0.1)  # every group size divides


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory, smollm_dir):
    return save_tiny_llama(tmp_path_factory.mktemp("float"), tokenizer_from=smollm_dir, **SHAPE)


def _run(path, **kw):
    llm = LLM(str(path), **{**ARGS, **kw})
    try:
        prompt = llm.generate(
            {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
        )
        greedy = llm.generate(
            {"prompt_token_ids": PROMPT[:8]}, SamplingParams(temperature=0, max_tokens=16, logprobs=2), use_tqdm=False
        )[0].outputs[0]
        assert llm.stats()["blocks_used"] == 0
        return np.array([p.logprob for p in prompt[0].prompt_logprobs[1:]]), greedy
    finally:
        llm.shutdown()


CASES = {
    "gptq-4bit-g32-asym": dict(method="gptq", bits=4, group=32),
    "gptq-4bit-g64-sym": dict(method="gptq", bits=4, group=64, sym=True),
    "gptq-4bit-g128-v2": dict(method="gptq", bits=4, group=128, checkpoint_format="gptq_v2"),
    "gptq-8bit-g32": dict(method="gptq", bits=8, group=32),
    "gptq-4bit-act-order": dict(method="gptq", bits=4, group=32, desc_act=True),
    # q, k and v in different orders: that fused weight is float, the others int4
    "gptq-4bit-act-order-mixed": dict(method="gptq", bits=4, group=32, desc_act=True, shared_order=False),
    "awq-4bit-g32": dict(method="awq", group=32),
    "awq-4bit-g128": dict(method="awq", group=128),
}


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_computes_its_dequantized_weights(case, float_dir, tmp_path):
    quantized, reference = tmp_path / "q", tmp_path / "ref"
    write_quantized(float_dir, quantized, reference, **CASES[case])
    got, got_greedy = _run(quantized)  # quantization comes from the checkpoint's config
    ref, ref_greedy = _run(reference)
    bf16, _ = _run(reference, dtype="bfloat16")
    # The int4 kernels round at most the linears' activations to bf16 (CPUs with bf16 dot
    # products; float32 sums elsewhere): the reference with every activation in bf16 bounds it.
    gap, bound = np.abs(got - ref).max(), max(np.abs(bf16 - ref).max(), 1e-4)
    print(f"{case}: |dlogprob| vs dequantized float {gap:.6f} (bound {bound:.6f})")
    assert gap <= bound
    for tok, want, top in zip(got_greedy.token_ids, ref_greedy.token_ids, ref_greedy.logprobs):
        margin = top.top[0][1] - top.top[1][1]
        if margin <= 2 * bound:
            break  # a near-tie that rounding may part: later tokens follow different contexts
        assert tok == want


def test_a_setting_that_disagrees_with_the_checkpoint_is_refused(float_dir, tmp_path):
    write_quantized(float_dir, tmp_path / "q", tmp_path / "ref", method="gptq")
    with pytest.raises(InvalidRequestError, match="gptq-quantized"):
        LLM(str(tmp_path / "q"), quantization="int8", **ARGS)
    with pytest.raises(InvalidRequestError, match="no quantization_config"):
        LLM(str(tmp_path / "ref"), quantization="awq", **ARGS)


@pytest.mark.parametrize(
    "config, field",
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "3"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "gemv"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"}, "marlin"),
        ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
    ],
)
def test_quantization_configs_not_implemented_are_refused(float_dir, tmp_path, config, field):
    write_quantized(float_dir, tmp_path / "q", tmp_path / "ref", method="gptq")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"] = config
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidRequestError, match=field):
        LLM(str(tmp_path / "q"), **ARGS)
