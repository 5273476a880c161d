"""Quantized KV cache rows: int8 and fp8 (e4m3). Each (token, KV head) row is head_dim
quantized values followed by its own scale, 2 bytes of float16 (absmax / 127 for int8, absmax /
448 for fp8; symmetric). No calibration: the scale is the row's, so no row saturates and none
is quantized coarser than its own range (vLLM's uncalibrated fp8 uses scale 1.0 instead).

Keeping the scale inside the row keeps one tensor per layer with the float cache's shape but
the last dim (head_dim + 2): block copies, the KV hand-off and head slicing move the scales
with the values, and a block's bytes are what the pool is sized from. A float16 scale (not
float32) is what makes an 8-bit cache hold 1.94x the tokens of bfloat16 at head_dim 64 (float32
scales: 1.88x); its 11-bit mantissa adds ~0.05% to a scale, far below int8's step of 1/254.

PyTorch has no CPU index_copy_/index_select for float8, so writes and gathers of a quantized
cache go through a uint8 view of the same bytes (`byte_view`).
"""

from __future__ import annotations

import torch

from engine.errors import InvalidRequestError

SCALE_BYTES = 2
_FP16_MAX = 65504.0
_STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # a row's absmax maps to this


def check_kv_backend(kv_cache_dtype: str, backend: str, device: torch.device) -> None:
    """Refuse at start a KV format the chosen attention backend cannot read: the C++ CPU ops read
    int8 rows but not fp8 ones, and Triton converts fp8 only on GPUs that have it (sm_89+)."""
    if kv_cache_dtype != "fp8_e4m3":
        return
    if backend == "cpu_paged":
        raise InvalidRequestError(
            "kv_cache_dtype='fp8_e4m3' is for GPUs with fp8; on CPU use kv_cache_dtype='int8' (the same "
            "memory; the C++ ops read it) or set ORBITAL_ATTENTION_BACKEND=reference"
        )
    if backend == "triton_paged" and torch.cuda.get_device_capability(device) < (8, 9):
        raise InvalidRequestError(
            f"kv_cache_dtype='fp8_e4m3' needs a GPU with fp8 (compute capability 8.9 or newer); "
            f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}: use int8"
        )


def cache_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return _STORAGE.get(kv_cache_dtype, model_dtype)


def is_quantized_cache(dtype: torch.dtype) -> bool:
    """A cache tensor of this dtype holds quantized rows with their scales."""
    return dtype in QMAX


def storage_row_width(storage: torch.dtype, head_dim: int) -> int:
    """Elements of one cache row (the cache's last dim), from the cache tensor's dtype."""
    return head_dim + SCALE_BYTES if is_quantized_cache(storage) else head_dim


def row_width(kv_cache_dtype: str, head_dim: int) -> int:
    """The same, from the kv_cache_dtype setting."""
    return storage_row_width(_STORAGE.get(kv_cache_dtype, torch.float32), head_dim)


def byte_view(cache: torch.Tensor) -> torch.Tensor:
    """A quantized cache as uint8 (same bytes, same shape); others as they are."""
    return cache.view(torch.uint8) if is_quantized_cache(cache.dtype) else cache


def quantize_rows(x: torch.Tensor, storage: torch.dtype = torch.int8) -> torch.Tensor:
    """[..., D] float -> [..., D + 2] `storage` (int8 or float8_e4m3fn): the values, then the
    float16 scale's bytes."""
    qmax = QMAX[storage]
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / qmax).clamp_(max=_FP16_MAX).to(torch.float16)
    s = scale.float()
    y = torch.where(s > 0, xf / torch.where(s > 0, s, 1.0), 0.0)
    if storage == torch.int8:
        y = y.round_()
    q = y.clamp_(-qmax, qmax).to(storage)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1).view(storage)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 2] quantized rows -> [..., D] in `dtype` (computed in float32, then cast)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float16).float()
    return (rows[..., :d].float() * scale).to(dtype)


def round_trip(x: torch.Tensor, storage: torch.dtype = torch.int8) -> torch.Tensor:
    """x as a quantized cache returns it: what attention over freshly written keys must see, so
    a prompt attends to the same values whether its prefix came from the cache or not."""
    return dequantize_rows(quantize_rows(x, storage), x.dtype)
