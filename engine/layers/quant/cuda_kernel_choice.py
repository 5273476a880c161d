"""Which kernels run quantized weights on CUDA: the Triton GEMMs (triton_weight_gemm.py), where
the triton package imports, or PyTorch's own (tinygemm's int4 pack, an int8 weight widened per
call). Defaults, from the H200 measurements in docs/gpu.md: int8 through Triton (0.9-1.0x bf16's
tokens/s against 0.4-0.5x widened at batch 1-32), int4 through tinygemm (1.28x the Triton
kernel's tokens/s at batch 1; Triton gives 1.12-1.21x at batch 32-256).
`ORBITAL_CUDA_QUANT_KERNEL=triton|torch` sets both (the GPU benchmark compares them); the int4
choice is made when a weight is packed, and the quantized-weights cache keys on it."""

from __future__ import annotations

import functools
import os

KINDS = ("triton", "torch")
DEFAULTS = {"int8": "triton", "int4": "torch"}


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def cuda_quant_kernel(method: str) -> str:
    """ "triton" or "torch" for `method` ("int8", or "int4": int4 groups and GGUF blocks)."""
    kind = os.environ.get("ORBITAL_CUDA_QUANT_KERNEL") or DEFAULTS[method]
    if kind not in KINDS:
        raise ValueError(f"ORBITAL_CUDA_QUANT_KERNEL={kind!r}: expected one of {', '.join(KINDS)}")
    return "triton" if kind == "triton" and _triton_imports() else "torch"
