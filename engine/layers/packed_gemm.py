"""Linear layers on CPU with weights pre-packed for oneDNN.

`F.linear` on CPU re-lays the weight out for its GEMM kernel on every call (and for float32 it
goes to a BLAS that, on the AMD EPYC this project is measured on, runs at ~40% of oneDNN's
speed). Packing each weight once at load time into oneDNN's blocked layout removes that work:
measured over the 121 linears of a SmolLM2-135M decode step with weights coming from memory,
bf16 1.1-1.4x at 16-256 rows (none at 2048), float32 2-2.9x (`python -m bench.bench_packed_gemm`).

oneDNN builds a kernel per (weight shape, row count), ~1-2 ms each, so row counts are rounded up
to a few buckets (padding rows are zeros and sliced off): a serving run sees every batch size.
ORBITAL_PACKED_GEMM=0 turns packing off (plain `F.linear`).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


def packing_enabled(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or os.environ.get("ORBITAL_PACKED_GEMM", "1") == "0":
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_weight(w: torch.Tensor) -> nn.Parameter:
    """A [out, in] weight in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None), requires_grad=False)


def row_bucket(m: int) -> int:
    """Row count a GEMM runs with: 8 buckets per power of two (about 50 up to 2048 rows), so
    padding stays under 1/8 of the rows (or under 8 rows, where reading weights dominates)."""
    step = max(8, (1 << max(m.bit_length() - 1, 0)) // 8)
    return -(-m // step) * step


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, or the packed oneDNN GEMM when `weight` was packed by `pack_weight`."""
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    mb = row_bucket(m)
    if mb != m:
        padded = x2.new_empty(mb, x2.shape[1])
        padded[:m] = x2
        padded[m:] = 0
        x2 = padded
    y = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
    return y[:m].reshape(*x.shape[:-1], y.shape[-1])
