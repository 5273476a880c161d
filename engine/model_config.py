"""What the engine needs to know about a model, resolved once from its HF config."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.choices import DTYPES
from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.lora.config import LoRAConfig

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # choices.DTYPES


def cpu_has_fast_bf16() -> bool:
    from engine.kernels.cpu_ops import cpu_flags  # one reader of /proc/cpuinfo

    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def bf16_op_runs() -> bool:
    """Whether bf16 weights take Orbital's few-row op at every row count on this CPU (a vector
    build where PyTorch's bf16 GEMM is emulated: engine/layers/packed_gemm.py)."""
    from engine.layers.packed_gemm import bf16_gemm_native, small_linear_ops

    return not bf16_gemm_native() and small_linear_ops() is not None


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, quantization: str | None = None) -> torch.dtype:
    """`auto`: bfloat16 where it is fast (CUDA with bf16, CPUs with AVX-512 BF16 / AMX), and for
    float weights where bf16 ones take the few-row op at every row count (AVX2: bf16 decodes
    1.4-1.7x faster than float32 at every load on a 2-core EPYC, half the weight bytes; a long
    prompt ~1.2x slower); else float32 (quantized weights keep float32 activations there: the
    int4 paths' exact mode was measured with them)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if cpu_has_fast_bf16() or (quantization is None and bf16_op_runs()):
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise InvalidRequestError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if _DTYPES[dtype] == torch.bfloat16 and device.type == "cpu" and not cpu_has_fast_bf16() and not bf16_op_runs():
        log.warning(
            "dtype=bfloat16 on a CPU without AVX512-BF16 or AMX, with the few-row op off or not built "
            "(ORBITAL_SMALL_LINEAR=0, a generic build): bf16 matmuls are emulated, ~3x slower than float32"
        )
    return _DTYPES[dtype]


@dataclass(frozen=True)
class ModelConfig:
    model_dir: Path
    hf_config: object = field(repr=False)
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    served_name: str
    quantization: str | None = None  # weight-only ("int8", "int4[:gN]", "gguf", "gptq", "awq"): engine/layers/quant/
    gguf_file: Path | None = None  # quantization="gguf": the file whose blocks are loaded
    int8_activations: bool = False  # the quantized linears round activations to int8 (quant/int4.py)
    lora: LoRAConfig | None = None  # multi-LoRA slots on every worker (engine/lora/); None: off

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.hf_config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        from engine.model.llama_layers import head_dim_of

        return head_dim_of(self.hf_config)

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


def checkpoint_method(hf_config: object, quantization: str | None) -> str | None:
    """A GPTQ / AWQ checkpoint's method (its quantization_config) when the setting is None; a
    setting that disagrees with the checkpoint is refused (its weights are already integers)."""
    from engine.model.gptq_awq import METHODS, checkpoint_quantization

    q = checkpoint_quantization(hf_config)
    if q is None:
        if quantization in METHODS:
            raise InvalidRequestError(
                f"quantization={quantization!r} needs a {quantization} checkpoint; this model has no quantization_config"
            )
        return quantization
    if quantization not in (None, q.method):
        raise InvalidRequestError(
            f"this checkpoint is {q.method}-quantized; quantization={quantization!r} cannot apply to it"
        )
    return q.method


def check_int8_activations(quantization: str | None, device: torch.device) -> None:
    """int8 activations are the int4 op's (quant/int4.py mark_int8_activations): quantized weights
    on a CPU whose op has VNNI, VBMI and BITALG (`quantization`: after a GPTQ / AWQ checkpoint's own)."""
    from engine.layers.quant.int4 import int8_dot_runs

    if quantization is None:
        raise InvalidRequestError("int8_activations applies to quantized weights: set quantization (int4, gguf, ...)")
    if device.type != "cpu":
        raise InvalidRequestError(f"int8_activations runs on CPU (the C++ int4 op); on {device} leave it off")
    if not int8_dot_runs():
        raise InvalidRequestError(
            "int8_activations needs a CPU with AVX-512 VNNI, VBMI and BITALG (AMD Zen 4, Intel Ice Lake or later) "
            "and the C++ CPU ops; this one computes quantized weights with bf16 or float32 activations only"
        )


def build_model_config(
    model: str | None,
    dtype: str | torch.dtype,
    device: torch.device,
    max_model_len: int | None = None,
    served_name: str | None = None,
    quantization: str | None = None,
    int8_activations: bool = False,
) -> ModelConfig:
    from transformers import AutoConfig

    from engine.layers.quant import parse_quantization
    from engine.layers.quant.spec import check_quantization_device
    from engine.model.config_check import check_model_config, sliding_window_of
    from engine.model.loader import gguf_file_of, resolve_model_dir

    spec = parse_quantization(quantization)  # refuses unknown settings before any conversion
    if spec is not None:
        check_quantization_device(quantization, torch.device(device))
    gguf_file = gguf_file_of(model) if spec is not None and spec.method == "gguf" else None
    if spec is not None and spec.method == "gguf" and gguf_file is None:
        raise InvalidRequestError(f"quantization='gguf' loads a GGUF file's blocks; {model!r} is not a .gguf file")
    model_dir = resolve_model_dir(model, float_weights=gguf_file is None)
    cfg = AutoConfig.from_pretrained(model_dir)
    quantization = checkpoint_method(cfg, quantization)
    if int8_activations:
        check_int8_activations(quantization, torch.device(device))
    try:
        check_model_config(cfg)  # in the driver: before any worker loads a model it would refuse
    except ValueError as e:
        raise InvalidRequestError(f"{model_dir}: {e}") from e
    limit = cfg.max_position_embeddings
    window = sliding_window_of(cfg)
    if window:
        limit = min(limit, window)  # no attention backend has a sliding window
    if max_model_len is None:
        max_model_len = limit
    elif max_model_len > limit:
        raise InvalidRequestError(f"max_model_len {max_model_len} exceeds the model's limit {limit}")
    eos = cfg.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        import json

        g = json.loads(gen.read_text()).get("eos_token_id")
        if g is not None:
            eos_ids = tuple(dict.fromkeys(list(eos_ids) + (g if isinstance(g, list) else [g])))
    from engine.model.gguf_convert import EMBEDDED_NAME

    default_name = EMBEDDED_NAME if not model or model == "default" else (Path(model).name or str(model))
    name = served_name or default_name
    return ModelConfig(
        model_dir,
        cfg,
        resolve_dtype(dtype, device, quantization),
        max_model_len,
        eos_ids,
        str(name),
        quantization,
        gguf_file,
        int8_activations,
    )
