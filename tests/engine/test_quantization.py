"""Weight-only int8 (engine/layers/quant/): the quantized linear against the float one at the
row counts of both of its paths, and the embedded model's perplexity on fixed prose (a Python
reference page that ships with CPython: `pydoc_data.topics`, ~2.5k tokens) within 1% of float32;
greedy agreement with float32 is reported."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.layers.quant.int8 import INT8_MM_ROWS, int8_linear, quantize_int8
from tests.engine.path_agreement import FLOAT32_NOISE, assert_paths_agree, rounding_bound

ARGS = dict(dtype="float32", num_threads=2, kv_cache_memory_bytes=256 << 20, max_model_len=2048)


@pytest.mark.parametrize("rows", [1, 7, INT8_MM_ROWS, INT8_MM_ROWS + 1, 200])
def test_int8_linear_matches_float(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(192, 256, generator=g) * torch.linspace(0.1, 3.0, 192)[:, None]  # scales differ per row
    bias, x = torch.randn(192, generator=g), torch.randn(rows, 256, generator=g)
    q = quantize_int8(w)
    assert q.dtype == torch.int8 and q.scale.shape == (192,)
    ref = torch.nn.functional.linear(x, w, bias)
    got = int8_linear(x, q, bias)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert got.dtype == x.dtype and rel < 0.01, rel  # 8-bit weights (and bf16 activations below 33 rows)


def _text_ids(llm: LLM) -> list[int]:
    from pydoc_data.topics import topics

    return llm.tokenizer(topics["assignment"]).input_ids[:2000]


def _perplexity(llm: LLM, ids: list[int]) -> float:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.error is None, out.error
    nll = [-lp.logprob for lp in out.prompt_logprobs[1:]]
    return math.exp(sum(nll) / len(nll))


PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Water boils at", "List three colors:"]


def quality(**llm_kwargs) -> tuple[float, list[list[int]]]:
    """An engine's perplexity on the fixed text and its greedy tokens for PROMPTS (24 each);
    its pool is whole after. Computed once per run for each set of settings (an engine's outputs
    are a function of them: the float32 reference serves several test files)."""
    return _quality(tuple(sorted(llm_kwargs.items())))


@functools.cache
def _quality(settings: tuple) -> tuple[float, list[list[int]]]:
    llm = LLM(**dict(settings))
    try:
        ppl = _perplexity(llm, _text_ids(llm))
        params = SamplingParams(temperature=0, max_tokens=24)
        greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert llm.stats()["blocks_used"] == 0
        return ppl, greedy
    finally:
        llm.shutdown()


def agreement(greedy_a: list[list[int]], greedy_b: list[list[int]]) -> float:
    pairs = [(a, b) for ga, gb in zip(greedy_a, greedy_b) for a, b in zip(ga, gb)]
    return sum(a == b for a, b in pairs) / len(pairs)


@pytest.mark.slow  # a perplexity over a long text: make test runs it, make test-fast does not
def test_int8_weights_perplexity_within_one_percent_of_float32():
    results = {q: quality(quantization=q, **ARGS) for q in (None, "int8")}
    (ppl_f, greedy_f), (ppl_q, greedy_q) = results[None], results["int8"]
    agree = agreement(greedy_f, greedy_q)
    print(f"perplexity float32 {ppl_f:.3f}, int8 {ppl_q:.3f} ({ppl_q / ppl_f - 1:+.2%}); greedy agreement {agree:.0%}")
    assert abs(ppl_q / ppl_f - 1) < 0.01, (ppl_f, ppl_q)


def test_quantization_off_cpu_and_cuda_is_refused_before_loading():
    from engine.layers.quant.spec import check_quantization_device

    check_quantization_device("int4", torch.device("cpu"))
    with pytest.raises(InvalidRequestError, match="runs on CPU and CUDA"):
        check_quantization_device("int8", torch.device("mps"))
    with pytest.raises(InvalidRequestError, match="runs on CPU and CUDA"):
        LLM(quantization="int8", device="meta", dtype="float32", num_threads=1)


def test_unknown_quantization_is_refused():
    with pytest.raises(InvalidRequestError, match="quantization must be one of"):
        LLM(quantization="int3", **ARGS)


@pytest.mark.slow
def test_int8_with_prefix_cache_hits_and_preemption_keeps_its_tokens():
    """The same int8 engine's greedy tokens, alone with a roomy pool, then again in a batch that
    hits the prefix cache and a pool small enough to preempt: the same up to a near-tie. A few
    rows multiply bf16 activations (PyTorch's int8 kernel, or the int4 op where int8 runs as
    nibbles): every activation in bf16 bounds that rounding's effect."""
    assert_hits_and_preemption_keep_tokens(rounding={"dtype": "bfloat16"}, quantization="int8")


def assert_hits_and_preemption_keep_tokens(rounding: dict | None = None, **llm_kwargs) -> None:
    """Greedy outputs of an engine built with `llm_kwargs`: each prompt alone on a roomy pool,
    then all at once on a 12-block pool holding their shared prefix (hits, preemption): the
    same up to a near-tie, logprobs within the bound, the small pool whole after.

    The recompute and the hits meet other GEMM shapes than the prompt alone. Where the engine
    rounds an intermediate to a coarse format (a quantized KV row, bf16 activations into an int4
    op), `rounding` names the same engine one format finer or coarser; the bound is measured
    from it (tests/engine/path_agreement.py). Without it the paths are float32 throughout."""
    shared = "A lighthouse keeper wrote in his log every night about the ships and the weather. "
    prompts = [shared + p for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    roomy_kw = dict(dtype="float32", num_threads=2, max_model_len=256, kv_cache_memory_bytes=64 << 20)
    bound = FLOAT32_NOISE
    for kw, role in [(llm_kwargs, "expected")] + ([(llm_kwargs | rounding, "rounding")] if rounding else []):
        roomy = LLM(**(roomy_kw | kw))
        try:
            outs = [roomy.generate(p, params, use_tqdm=False)[0] for p in prompts]
        finally:
            roomy.shutdown()
        if role == "expected":
            expected = outs
        else:
            bound = rounding_bound(expected, outs)
    small = LLM(dtype="float32", num_threads=2, num_blocks=12, block_size=16, max_model_len=256, **llm_kwargs)
    try:
        small.generate(prompts[0], params, use_tqdm=False)  # leaves the shared prefix cached
        got = small.generate(prompts, params, use_tqdm=False)
        stats = small.stats()
        small.engine.core.scheduler.check_integrity()
    finally:
        small.shutdown()
    print(f"path bound {bound:.2e}")
    assert_paths_agree(got, expected, bound)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["blocks_used"] == 0, stats


def test_cuda_quant_kernel_choice(monkeypatch):
    """Defaults per method (int8 through Triton where it imports, int4 through tinygemm); the
    variable sets both; a wrong value is refused by name."""
    from engine.layers.quant.cuda_kernel_choice import _triton_imports, cuda_quant_kernel

    triton = "triton" if _triton_imports() else "torch"
    monkeypatch.delenv("ORBITAL_CUDA_QUANT_KERNEL", raising=False)
    assert cuda_quant_kernel("int8") == triton and cuda_quant_kernel("int4") == "torch"
    monkeypatch.setenv("ORBITAL_CUDA_QUANT_KERNEL", "torch")
    assert cuda_quant_kernel("int8") == "torch"
    monkeypatch.setenv("ORBITAL_CUDA_QUANT_KERNEL", "triton")
    assert cuda_quant_kernel("int4") == triton
    monkeypatch.setenv("ORBITAL_CUDA_QUANT_KERNEL", "cutlass")
    with pytest.raises(ValueError, match="expected one of triton, torch"):
        cuda_quant_kernel("int4")
