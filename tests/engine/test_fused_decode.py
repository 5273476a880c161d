"""The fused decode layers (engine/model/fused_decode.py, decode_layers.cpp) against the same model
run layer by layer (ORBITAL_FUSED_DECODE=0): tokens and logprobs must be equal, bit for bit, since
both run the same ops on the same values. Each engine gets up to 7 requests of different lengths,
so steps of 1-4 decode rows (fused), of more rows and with prompt chunks (layer by layer) mix.
Where the C++ ops have no vector path the fused call is not built and the layers run; the test
checks that instead."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.layers.packed_gemm import small_linear_ops
from engine.layers.quant.int4 import small_linear_ops as int4_small_linear_ops
from engine.layers.quant.int4 import small_rows
from engine.model.fused_decode import FusedDecode
from tests.engine.gil import Spinner
from tests.engine.test_tiny_models import _save_tiny

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox",
    "Write a short story about a robot who learns to paint. " * 3,
    "def fib(n):",
    "List three colours:",
    "One two three four five six seven eight nine ten " * 5,
    "Hello",
    "A haiku about the sea",
]


def _params(n: int) -> list[SamplingParams]:
    # Different lengths (rows leave the batch one by one), greedy and seeded sampling, logprobs.
    return [
        SamplingParams(max_tokens=6 + 5 * i, temperature=0 if i % 2 == 0 else 0.8, seed=i, logprobs=2, ignore_eos=True)
        for i in range(n)
    ]


def _fused_expected(kw: dict) -> bool:
    """Where the few-row ops take every linear: a vector path, and for 4-bit weights the int4 op
    (where it reads PyTorch's int4 pack: engine/layers/quant/int4.py)."""
    quantized = kw.get("quantization") is not None
    return small_linear_ops() is not None and (not quantized or int4_small_linear_ops() is not None)


def _generate(monkeypatch, fused: bool, prompts, params=None, check=None, **kw) -> tuple[list, list[int]]:
    """(per request: token ids, logprobs with their top-2), the rows of each step the fused call
    ran; `check(model)` (if given) asks what it wants of the loaded model."""
    monkeypatch.setenv("ORBITAL_FUSED_DECODE", "1" if fused else "0")
    ran = []
    real = FusedDecode.run

    def counting(self, x, positions):
        out = real(self, x, positions)
        if out is not None:
            ran.append(x.shape[0])
        return out

    monkeypatch.setattr(FusedDecode, "run", counting)
    llm = LLM(num_threads=2, num_blocks=128, block_size=16, max_num_batched_tokens=64, **kw)
    model = llm.engine.core.executor.runner.model.model
    if check is not None:
        check(model)
    outs = llm.generate(prompts, params or _params(len(prompts)), use_tqdm=False)
    assert (model._fused is not None) == (fused and _fused_expected(kw))  # None: every step ran the layers
    got = [(o.outputs[0].token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.outputs[0].logprobs]) for o in outs]
    return got, ran


@pytest.mark.parametrize(
    "kw",
    [
        {"quantization": "gguf"},  # the GGUF's Q4_1 blocks and two-nibble Q8_0 (the tied head)
        {"quantization": "gguf", "kv_cache_dtype": "int8"},
        {"dtype": "bfloat16"},
        {"quantization": "gguf", "dtype": "bfloat16"},  # bf16 x: exact mode widens it to float32
        {"quantization": "int4", "dtype": "float32"},  # float32 activations rounded to bf16 for the op
        {"quantization": "int8", "dtype": "float32"},  # int8 as two nibbles where the int4 op runs
    ],
    ids=["gguf", "gguf-int8kv", "bf16", "gguf-bf16", "int4-f32", "int8-f32"],
)
def test_fused_decode_is_bit_identical_to_the_layers(monkeypatch, kw):
    want, _ = _generate(monkeypatch, False, PROMPTS, **kw)
    got, fused_steps = _generate(monkeypatch, True, PROMPTS, **kw)
    assert got == want
    if _fused_expected(kw):
        assert len(fused_steps) > 20  # it ran (most steps of 1-4 rows)


def test_fused_decode_of_up_to_24_int4_rows(monkeypatch):
    """24 streams of a 4-bit model: steps of up to 24 decode rows, fused where the int4 op takes
    them (AVX-512 BF16: up to 63 rows), bit-identical to the layers."""
    prompts = [f"{p} ({i})" for i in range(6) for p in PROMPTS][:24]
    params = [SamplingParams(max_tokens=10 + i % 5, temperature=0, logprobs=2, ignore_eos=True) for i in range(24)]
    kw = {"quantization": "gguf"}
    want, _ = _generate(monkeypatch, False, prompts, params, **kw)
    got, fused_steps = _generate(monkeypatch, True, prompts, params, **kw)
    assert got == want
    if _fused_expected(kw) and small_rows() >= 24:
        assert max(fused_steps) == 24, fused_steps
    elif _fused_expected(kw):
        assert fused_steps and max(fused_steps) <= small_rows()


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_fused_decode_with_qkv_bias(monkeypatch, tmp_path, smollm_tokenizer, quantization):
    """Qwen2's QKV bias: the int4 path adds it after rounding, the float one inside the op."""
    # head_dim 64 (the fused ops' widths; the tiny models' 16 is declined by the rotary op)
    _save_tiny("qwen2", tmp_path, smollm_tokenizer, random_biases=True, hidden_size=256, intermediate_size=512)
    prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 7 * i))} for i in range(5)]
    kw = {"model": str(tmp_path), "dtype": "float32"} | ({"quantization": quantization} if quantization else {})
    want, _ = _generate(monkeypatch, False, prompts, **kw)
    got, fused_steps = _generate(monkeypatch, True, prompts, **kw)
    assert got == want
    if _fused_expected(kw):
        assert len(fused_steps) > 10


class _TimedProgram:
    """The fused call's C++ program with each `run` timed (the Python around it excluded)."""

    def __init__(self, program, spin: Spinner) -> None:
        self.program, self.spin = program, spin

    def run(self, *args):
        return self.spin.timed(lambda: self.program.run(*args))


def test_a_fused_step_lets_other_python_threads_run():
    """A served decode step is one C++ call of ~10-20 ms: it drops the GIL, so the replica's
    asyncio loop hands the previous step's tokens over meanwhile instead of one step late."""
    llm = LLM(num_threads=2, num_blocks=64, block_size=16, dtype="bfloat16")
    try:
        model = llm.engine.core.executor.runner.model.model
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        llm.generate(PROMPTS[:1], params, use_tqdm=False)  # builds the fused program where it applies
        if model._fused is None:
            assert not _fused_expected({"dtype": "bfloat16"})
            return
        with Spinner() as spin:
            model._fused.program = _TimedProgram(model._fused.program, spin)
            llm.generate(PROMPTS[:1], params, use_tqdm=False)
        assert len(spin.calls) >= 20
        assert spin.stamps_inside(min_seconds=0.002) > 0, spin.calls
    finally:
        llm.shutdown()


def _q5_mix(name: str) -> str | None:
    """Q5_0 and Q5_1 where SmolLM2's 576 inputs rule out K-quants (llama-quantize's Q4_K_M
    fallbacks), Q4_K on the down projection."""
    linear = name.split(".")[-2]
    if linear == "ffn_down":
        return "Q4_K"
    if linear in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"):
        return "Q5_1" if linear == "attn_output" else "Q5_0"
    return None


def test_fused_decode_of_5_bit_weights(monkeypatch, tmp_path):
    """A 2-layer GGUF of Q5_0 / Q5_1 tensors: where the C++ ops run them they are packed 5-bit
    (nibbles and high bits) and the fused call reads the bit planes, bit-identical to the layers."""
    from engine.layers.quant.int4 import five_bit_runs
    from engine.model.gguf_convert import embedded_gguf_path
    from tests.engine.gguf_subset import write_gguf_subset

    path = write_gguf_subset(embedded_gguf_path(), tmp_path / "q5.gguf", 2, _q5_mix)
    kw = {"model": str(path), "quantization": "gguf"}

    def five_bit(model):
        layer = model.layers[0]
        five = [
            getattr(m.weight, "hi_bits", None) is not None for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)
        ]
        assert five == [five_bit_runs()] * 2

    want, _ = _generate(monkeypatch, False, PROMPTS, check=five_bit, **kw)
    got, fused_steps = _generate(monkeypatch, True, PROMPTS, **kw)
    assert got == want
    if _fused_expected(kw):
        assert len(fused_steps) > 20


@pytest.mark.parametrize("model", ["embedded", "q5"])
def test_fused_decode_with_int8_activations(monkeypatch, tmp_path, model):
    """int8_activations (kernels/cpu/int4_int8_dot.h): the fused call hands each linear's flag to
    the op, bit-identical to the layers, for the embedded GGUF (Q4_1, the two-nibble Q8_0 head) and
    5-bit weights. On a CPU without VNNI, VBMI and BITALG the setting is refused."""
    from engine.errors import InvalidRequestError
    from engine.layers.quant.int4 import int8_dot_runs
    from engine.model.gguf_convert import embedded_gguf_path
    from tests.engine.gguf_subset import write_gguf_subset

    kw = {"quantization": "gguf", "int8_activations": True}
    if model == "q5":
        kw["model"] = str(write_gguf_subset(embedded_gguf_path(), tmp_path / "q5.gguf", 2, _q5_mix))
    if not int8_dot_runs():
        with pytest.raises(InvalidRequestError, match="VNNI"):
            LLM(num_threads=2, num_blocks=128, **kw)
        return

    def marked(m):
        layer = m.layers[0]
        assert all(
            getattr(x.weight, "int8_activations", False) for x in (layer.self_attn.qkv_proj, layer.mlp.down_proj)
        )

    want, _ = _generate(monkeypatch, False, PROMPTS, check=marked, **kw)
    got, fused_steps = _generate(monkeypatch, True, PROMPTS, **kw)
    assert got == want
    assert len(fused_steps) > 20
