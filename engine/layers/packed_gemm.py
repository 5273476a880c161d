"""Linear layers on CPU with weights pre-packed for oneDNN.

`F.linear` on CPU re-lays the weight out for its GEMM kernel on every call (and for float32 it
goes to a BLAS that, on the AMD EPYC this project is measured on, runs at ~40% of oneDNN's
speed). Packing each weight once at load time into oneDNN's blocked layout removes that work:
measured over the 121 linears of a SmolLM2-135M decode step with weights coming from memory,
bf16 1.1-1.4x at 16-256 rows (none at 2048), float32 2-2.9x (`python -m bench.bench_packed_gemm`).

oneDNN builds a kernel per (weight shape, row count), ~1-2 ms each, so row counts are rounded up
to a few buckets (padding rows are zeros and sliced off): a serving run sees every batch size.
ORBITAL_PACKED_GEMM=0 turns packing off (plain `F.linear`).

At a few rows (decode at low concurrency) a linear only streams its weight once, and oneDNN's
GEMM stays far below the memory bandwidth: over a SmolLM2 decode step's 121 linears at one row,
float32, 44 ms against 22 ms for the C++ `small_linear` op reading the plain weight at ~20 GB/s
(`python -m bench.bench_packed_gemm`). So where that op has a vector path each packed weight keeps
its plain tensor too (`.plain`; twice the weight memory, none for a tied LM head, whose plain
weight is the embedding) and rows <= SMALL_ROWS go through it. ORBITAL_SMALL_LINEAR=0 turns it off.

A bfloat16 weight on a CPU without bf16 dot products (AVX2, AVX-512 without BF16) is not packed
for oneDNN, and PyTorch's bf16 GEMM is emulated there: over a SmolLM2 step's linears on a 2-core
AVX2 EPYC, 130 ms at 8 rows and 480 at 32 against the op's ~30 and ~120. So such a weight takes
the op at every row count, OP_ROWS rows per call (small_rows): float32 sums of the bf16 weights
widened on load, each row's result the same whatever rows share its call. Where the op is built
for AVX2, the weight is repacked at load into panels of 16 rows (pack_rows16, the same bytes)
that its outer-product path reads (small_linear_rows16.cpp): 1.3-1.9x at 8-64 rows.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.quant.cuda_int4 import is_cuda_int4


def packing_enabled(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or os.environ.get("ORBITAL_PACKED_GEMM", "1") == "0":
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and (bf16_gemm_native() or rows16_enabled()))


SMALL_ROWS = 4
OP_ROWS = 64  # rows per call of the op (its own limit)


@functools.cache
def bf16_gemm_native() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def small_rows(weight: torch.Tensor) -> int | None:
    """Rows up to which `linear` runs the few-row op on this weight; None: at every row count (a
    plain bf16 weight where PyTorch's bf16 GEMM is emulated)."""
    if weight.dtype == torch.bfloat16 and not weight.is_mkldnn and not bf16_gemm_native():
        return None
    return SMALL_ROWS


def small_linear_ops() -> ModuleType | None:
    """The C++ ops when their few-row linear has a vector path here, else None."""
    return _vector_ops(os.environ.get("ORBITAL_SMALL_LINEAR", "1") != "0")


@functools.cache
def _vector_ops(enabled: bool) -> ModuleType | None:
    # Asked by every linear at decode: the answer (a build, a pybind call) is computed once.
    if not enabled:
        return None
    from engine.kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    return ops if ops is not None and ops.isa() != "generic" else None


def rows16_enabled() -> bool:
    """bf16 weights go to panels of 16 rows: the op is built for AVX2 and bf16 GEMMs are emulated."""
    ops = small_linear_ops()
    return ops is not None and ops.isa() == "avx2" and not bf16_gemm_native()


PANEL_ORDER = [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]  # one load: outputs 0-7 and 8-15


def pack_rows16(w: torch.Tensor) -> nn.Parameter:
    """A [out, in] bf16 weight as [ceil(out/16), in, 16] panels: per input, the panel's 16
    outputs side by side in PANEL_ORDER (rows past `out` are zeros); `.out_features` = out."""
    n, k = w.shape
    w = w.detach()
    if n % 16:
        w = torch.cat([w, w.new_zeros(-n % 16, k)])
    panels = nn.Parameter(w.view(-1, 16, k)[:, PANEL_ORDER].transpose(1, 2).contiguous(), requires_grad=False)
    panels.out_features, panels.plain = n, None
    return panels


def pack_weight(w: torch.Tensor) -> nn.Parameter:
    """A [out, in] weight in oneDNN's blocked layout (an opaque mkldnn tensor); `.plain` holds the
    plain weight for the few-row path where it runs (else None). A bf16 weight where the bf16
    GEMM is emulated: panels of 16 rows instead (pack_rows16), for the op alone."""
    if w.dtype == torch.bfloat16 and rows16_enabled():
        return pack_rows16(w)
    plain = w.detach().contiguous()
    packed = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(plain, None), requires_grad=False)
    packed.plain = plain if small_linear_ops() is not None else None
    return packed


def row_bucket(m: int) -> int:
    """Row count a GEMM runs with: 8 buckets per power of two (about 50 up to 2048 rows), so
    padding stays under 1/8 of the rows (or under 8 rows, where reading weights dominates)."""
    step = max(8, (1 << max(m.bit_length() - 1, 0)) // 8)
    return -(-m // step) * step


def _in_weight_order(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A packed int4 weight with `input_order` (GPTQ act-order) holds its columns in that order
    of the inputs: x is gathered to match. Asked of int4 weights only, not of every linear."""
    order = weight.input_order
    return x if order is None else x.index_select(-1, order)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, or the packed oneDNN GEMM when `weight` was packed by `pack_weight`; the
    few-row C++ op at up to SMALL_ROWS rows (CPU), at every row count for a weight small_rows()
    says so of; an int8 or int4 weight's own kernel (quant/;
    on CUDA, uint8 and int32 are the two int4 forms of cuda_int4.py)."""
    if weight.dtype == torch.int8:
        from engine.layers.quant.int8 import int8_linear

        return int8_linear(x, weight, bias)
    if is_cuda_int4(weight):
        from engine.layers.quant.cuda_int4 import int4_linear_cuda

        return int4_linear_cuda(_in_weight_order(x, weight), weight, bias)
    if weight.dtype == torch.uint8:
        from engine.layers.quant.int4 import int4_linear

        return int4_linear(_in_weight_order(x, weight), weight, bias)
    if weight.dim() == 3:
        return _rows16_linear(x, weight, bias)
    flat = x.dim() == 2  # the usual case: no reshapes (each costs ~2 us of dispatch per call)
    x2 = x if flat else x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if 0 < m and x2.is_cpu and (m <= SMALL_ROWS or small_rows(weight) is None):
        if weight.is_mkldnn:  # pack_weight kept `.plain` only where the op runs: no need to ask
            plain, ops = getattr(weight, "plain", None), _vector_ops(True)
        else:
            plain, ops = weight, small_linear_ops()
        if plain is not None and ops is not None:
            y = x2.new_empty(m, plain.shape[0])
            if _op_rows(ops, x2, plain, bias, y):
                return y if flat else y.reshape(*x.shape[:-1], y.shape[-1])
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    mb = row_bucket(m)
    if mb != m:
        padded = x2.new_empty(mb, x2.shape[1])
        padded[:m] = x2
        padded[m:] = 0
        x2 = padded
    y = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
    if mb != m:
        y = y[:m]
    return y if flat else y.reshape(*x.shape[:-1], y.shape[-1])


def _op_rows(ops: ModuleType, x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> bool:
    """y = the op's x2 . w^T + bias, OP_ROWS rows per call; False where it declines."""
    m = x2.shape[0]
    if m <= OP_ROWS:  # one call (no slicing: decode steps go through here per linear)
        return ops.small_linear(x2, w, bias, y)
    return all(ops.small_linear(x2[i : i + OP_ROWS], w, bias, y[i : i + OP_ROWS]) for i in range(0, m, OP_ROWS))


def _rows16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A weight in panels of 16 rows (pack_rows16): only the op reads them."""
    flat = x.dim() == 2
    x2 = x if flat else x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = x2.new_empty(x2.shape[0], weight.out_features)
    if x2.shape[0] and not _op_rows(_vector_ops(True), x2, weight, bias, y):
        raise RuntimeError(f"the few-row op refused a bf16 panel weight ({x2.dtype} x of {tuple(x2.shape)})")
    return y if flat else y.reshape(*x.shape[:-1], weight.out_features)
