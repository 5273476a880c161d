"""Every GGUF tensor type the gguf package knows is either decoded as blocks (gguf_blocks.py:
Q8_0, Q4_0/1, Q5_0/1, Q2_K..Q6_K) with exactly `gguf.quants.dequantize`'s values, dequantized
to float by gguf, or refused by name: never read as another type. The K-quant blocks run through
the int4 kernels at decode and prompt row counts; a Q4_K_M-like file (Q4_K, Q6_K, Q5_0/1, F16
beside Q4_1 in one fused parameter) computes with `quantization="gguf"` what its float
conversion computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from engine import LLM, SamplingParams
from engine.layers.quant import QuantSpec, quantize_param
from engine.layers.quant.blocks import BlockQuantized, assemble
from engine.layers.quant.int4 import int4_linear
from engine.layers.quant.int4_format import dequantize_int4, pack_int4
from engine.layers.weight_utils import copy_rows_into
from engine.model.gguf_blocks import BLOCK_KINDS
from engine.model.gguf_weights import tensor_weight
from tests.engine.kquant_encode import encode

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

# Byte offsets of each block kind's float16 scale fields: random bytes there could be inf or NaN.
F16_FIELDS = {
    "Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}  # fmt: skip


def _random_bytes(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    values, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // values, size), dtype=np.uint8)
    for at in F16_FIELDS.get(kind, []):
        raw[:, at : at + 2] = rng.uniform(-0.02, 0.02, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = torch.isnan(a) & torch.isnan(b)  # random bytes of float types hold NaNs
    return torch.equal(torch.where(nan, 0, a), torch.where(nan, 0, b))


@pytest.mark.parametrize("kind", [t.name for t in GGMLQuantizationType])
def test_every_gguf_type_is_decoded_exactly_dequantized_or_refused(kind):
    values = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]
    rows, cols = 4, max(512, 2 * values)
    raw = _random_bytes(kind, rows, cols)
    try:
        ref = torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32))
    except NotImplementedError:
        with pytest.raises(ValueError, match=f"type {kind} cannot be loaded"):
            tensor_weight(raw, kind, [rows, cols])
        return
    ref = ref.reshape(rows, cols)
    w = tensor_weight(raw, kind, [rows, cols])
    assert isinstance(w, BlockQuantized) == (kind in BLOCK_KINDS)
    assert _same(w.dequantize() if isinstance(w, BlockQuantized) else w, ref)
    assert _same(tensor_weight(raw, kind, [rows, cols], keep_blocks=False), ref)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_the_test_encoders_write_what_gguf_reads(kind):
    x = (np.random.default_rng(1).standard_normal((32, 512)) * 0.05).astype(np.float32)
    x[3] = 0.0
    back = np.asarray(dequantize(encode(x, kind), GGMLQuantizationType[kind])).reshape(x.shape)
    rel = np.linalg.norm(back - x) / np.linalg.norm(x)
    assert rel < {"Q4_K": 0.09, "Q6_K": 0.025}[kind], rel  # 4 and 6 bits round to nearest
    assert not back[3].any()


@pytest.mark.parametrize("kind", BLOCK_KINDS)
@pytest.mark.parametrize("rows", [1, 7, 70, 200])
def test_packed_blocks_run_through_the_int4_paths(kind, rows):
    """Decode-sized and prompt-sized calls against the decoded weight in float64. The kernels
    take bf16 activations where the CPU multiplies bf16 (1%: existing int4 bound), float32 sums
    of the exact weight elsewhere."""
    w = tensor_weight(_random_bytes(kind, 96, 512, seed=rows), kind, [96, 512])
    split = w.bits == 8
    packed = pack_int4(*w.as_nibbles(split), w.group, split=split)
    exact = w.dequantize()
    got = dequantize_int4(packed)
    assert (got - exact).abs().max() <= 2**-23 * exact.abs().max()  # the split's halves add once
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    ref = x.double() @ exact.double().t()
    rel = ((int4_linear(x, packed).double() - ref).norm() / ref.norm()).item()
    assert rel < 0.01, rel


def test_float_rows_beside_blocks_in_one_parameter_keep_their_values():
    """A fused qkv whose q is F16 and k, v quantized: the float rows were zeros when the blocks
    alone were packed; now the whole parameter keeps every row's exact values."""
    q = torch.randn(64, 256)
    k = tensor_weight(_random_bytes("Q4_K", 32, 256, 1), "Q4_K", [32, 256])
    v = tensor_weight(_random_bytes("Q6_K", 32, 256, 2), "Q6_K", [32, 256])
    param = torch.nn.Parameter(torch.empty(128, 256), requires_grad=False)
    copy_rows_into(param, 64, k)
    copy_rows_into(param, 0, q)
    copy_rows_into(param, 96, v)
    out = quantize_param(param, QuantSpec("gguf"))
    assert out.dtype == torch.float32 and not hasattr(out, "block_parts")
    assert torch.equal(out.data, torch.cat([q, k.dequantize(), v.dequantize()]))


def test_k_quant_pieces_of_one_parameter_share_the_smaller_group():
    """Q4_K (groups of 32) beside Q6_K (16) in one packed weight: the values stay exact."""
    a = tensor_weight(_random_bytes("Q4_K", 64, 256, 3), "Q4_K", [64, 256])
    b = tensor_weight(_random_bytes("Q6_K", 64, 256, 4), "Q6_K", [64, 256])
    whole = assemble([(0, a), (64, b)], 128)
    assert whole.group == 16 and whole.bits == 8 and whole.kind == "Q4_K+Q6_K"
    assert torch.equal(whole.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def _q4_k_m_like(name: str) -> str | None:
    """llama.cpp's Q4_K_M choices where a tensor's rows allow K-quants (SmolLM2's 576 inputs do
    not: those fall back to Q5_0/Q5_1/Q8_0 as llama-quantize falls back), and one F16 q."""
    if "ffn_down" in name:
        return "Q4_K" if name.startswith("blk.0.") else "Q6_K"
    if "attn_v" in name:
        return "Q5_0"
    if "attn_output" in name:
        return "Q5_1"
    return "F16" if name == "blk.1.attn_q.weight" else None


PROMPT = [9000 + 11 * i for i in range(40)] + list(range(300, 400, 2))
ARGS = dict(num_threads=2, kv_cache_memory_bytes=64 << 20, max_model_len=512)


def _prompt_logprobs(path, **kw) -> list[float]:
    llm = LLM(str(path), **ARGS, **kw)
    try:
        out = llm.generate(
            {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
        )
        assert llm.stats()["blocks_used"] == 0
        return [p.logprob for p in out[0].prompt_logprobs[1:]]
    finally:
        llm.shutdown()


@pytest.fixture
def q4_k_m_like(tmp_path):
    import shutil

    from engine.model.gguf_convert import converted_dir_for, embedded_gguf_path
    from tests.engine.gguf_subset import write_gguf_subset

    path = write_gguf_subset(embedded_gguf_path(), tmp_path / "mix.gguf", 2, _q4_k_m_like)
    yield path
    converted = converted_dir_for(path)  # the float conversion's cache entry
    shutil.rmtree(converted, ignore_errors=True)
    converted.with_name(converted.name + ".lock").unlink(missing_ok=True)


def test_a_q4_k_m_like_file_computes_what_its_float_conversion_computes(q4_k_m_like):
    float32 = np.array(_prompt_logprobs(q4_k_m_like, dtype="float32"))
    blocks = np.array(_prompt_logprobs(q4_k_m_like, dtype="float32", quantization="gguf"))
    bf16 = np.array(_prompt_logprobs(q4_k_m_like, dtype="bfloat16"))
    # The block kernels round at most the linears' activations to bf16: the same weights with every
    # activation in bf16 round more, so they bound the gap (float32 sums alone: ~1e-5).
    gap, bound = np.abs(blocks - float32).max(), max(np.abs(bf16 - float32).max(), 1e-3)
    print(f"Q4_K_M-like file: |dlogprob| blocks vs float32 max {gap:.5f}; bf16 vs float32 {bound:.5f}")
    assert gap <= bound
