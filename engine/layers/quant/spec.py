"""The `quantization=` setting, parsed once: which weight format and which int4 group size.

"int8"                     per output channel, quantized at load
"int4", "int4:g32|64|128"  group-wise (asymmetric: scale and min per group), at load
"gguf"                     a GGUF file's own blocks (Q8_0, Q4_*, Q5_*, Q2_K..Q6_K), loaded as they are
"gptq", "awq"              a GPTQ / AWQ checkpoint's own integers and scales (engine/model/gptq_awq.py);
                           taken from the checkpoint's quantization_config when the setting is None
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.choices import QUANTIZATION_METHODS as METHODS
from engine.errors import InvalidRequestError

INT4_GROUP_SIZES = (32, 64, 128)
INT4_DEFAULT_GROUP = 32  # measured: SmolLM2 perplexity +2.8% at g32 (g64 +4.2%, g128 +6.9%)


@dataclass(frozen=True)
class QuantSpec:
    method: str  # "int8" | "int4" | "gguf" | "gptq" | "awq"
    group_size: int | None = None  # int4 only

    def __str__(self) -> str:
        return f"int4:g{self.group_size}" if self.method == "int4" else self.method


def parse_quantization(value: str | None) -> QuantSpec | None:
    if value is None:
        return None
    if value not in METHODS:
        raise InvalidRequestError(f"quantization must be one of {METHODS} or None, got {value!r}")
    if value.startswith("int4"):
        group = int(value.split(":g")[1]) if ":g" in value else INT4_DEFAULT_GROUP
        return QuantSpec("int4", group)
    return QuantSpec(value)


def check_quantization_device(value: str, device: torch.device) -> None:
    """Quantized weights run on CPU (PyTorch's CPU int8/int4 kernels) and on CUDA (its int8
    kernel and tinygemm's int4, which needs compute capability 8.0+); refuse others up front."""
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise InvalidRequestError(f"quantization={value!r} runs on CPU and CUDA; on {device} serve float weights")
    if not value.startswith("int8") and torch.cuda.get_device_capability(device) < (8, 0):
        raise InvalidRequestError(
            f"quantization={value!r} on CUDA uses the int4 tensor-core kernel (compute capability 8.0+); "
            f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}: use int8"
        )
