"""The int8 KV cache: each (token, KV head) row is head_dim int8 values followed by its own
scale, 2 bytes of float16 (absmax / 127, symmetric). No calibration: the scale is the row's.

Keeping the scale inside the row keeps one tensor per layer with the float cache's shape but
the last dim (head_dim + 2): block copies, the KV hand-off and head slicing move the scales
with the values, and a block's bytes are what the pool is sized from. A float16 scale (not
float32) is what makes int8 hold 1.94x the tokens of bfloat16 at head_dim 64 (float32 scales:
1.88x); its 11-bit mantissa adds ~0.05% to a scale, far below int8's own step of 1/254.
"""

from __future__ import annotations

import torch

from engine.errors import InvalidRequestError

KV_CACHE_DTYPES = ("auto", "int8")
SCALE_BYTES = 2
_FP16_MAX = 65504.0


def check_kv_cache_dtype(name: str) -> str:
    if name not in KV_CACHE_DTYPES:
        raise InvalidRequestError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    return name


def cache_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return torch.int8 if kv_cache_dtype == "int8" else model_dtype


def row_width(kv_cache_dtype: str, head_dim: int) -> int:
    """Elements of one cache row (the cache's last dim)."""
    return head_dim + SCALE_BYTES if kv_cache_dtype == "int8" else head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 2] int8: the rounded values, then the float16 scale's bytes."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_(max=_FP16_MAX).to(torch.float16)
    s = scale.float()
    q = torch.where(s > 0, xf / torch.where(s > 0, s, 1.0), 0.0).round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 2] int8 -> [..., D] in `dtype` (computed in float32, then cast)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float16).float()
    return (rows[..., :d].float() * scale).to(dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 cache returns it: what attention over freshly written keys must see, so a
    prompt attends to the same values whether its prefix came from the cache or not."""
    return dequantize_rows(quantize_rows(x), x.dtype)
