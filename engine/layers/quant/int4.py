"""Group-wise int4 weights (int4_format.py: how they are stored) through the fastest path here:
the C++ few-row op, a widened GEMM, or PyTorch's own CPU int4 kernel
(`aten._weight_int4pack_mm_for_cpu`).

Where the CPU multiplies bf16 natively (AVX-512 BF16), up to CHUNKED_ROWS rows (decode steps,
prompt chunks) the C++ op `int4_small_linear` (kernels/cpu/int4_linear.cpp) runs, in chunks of its
64 rows, reading the packed nibbles in place: 1.1-1.3x faster than PyTorch's kernel over a decode
step's linears at 4-16 rows (`python -m bench.bench_quant_kernels`), 1.4x over a whole 32-row
step, 1.1-1.4x the widened GEMM at 64-256 rows; past it the weight is widened to bf16 once per
call (kernels/cpu/int4_dequantize.cpp, the kernel's own weight rounded to bf16) for oneDNN's bf16
GEMM: 2.4x PyTorch's kernel at 512 rows. The few-row op is given what that kernel computes with (bf16 activations, its bf16 scales
and zeros) and sums in float32: a row's result does not depend on how many rows share the call,
so preemption's recompute and batching keep a sequence's greedy tokens.

Elsewhere (AVX2, AVX-512 without BF16: exact_mode) a bf16 GEMM is emulated, so every path computes
with the exact scales and mins and the activations as they are: the op up to CHUNKED_ROWS rows,
past it the weight widened exactly to float32 for a float32 GEMM. PyTorch's kernel runs only where
the op has no vector path.

An LM head's logits go through the op at every row count (int4_logits): it keeps float32 sums.
ORBITAL_INT4_SMALL_LINEAR=0 turns the op off.

5-bit weights (int4_format.py `.hi_bits`) are packed only where the C++ ops take every row count
(five_bit_runs): PyTorch's kernel has no high bits.

With the `int8_activations` setting (mark_int8_activations) every marked weight runs through the
op at every row count on activations rounded to int8 (kernels/cpu/int4_int8_dot.h).
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from engine.layers.quant.int4_format import SCALE_ROWS, block_pairs, dequantize_int4, pack_layout

SMALL_ROWS = 16  # rows up to which int4_small_linear runs where the CPU has no bf16 dot products
OP_ROWS = 64  # the op's own limit per call (int4_linear.cpp kMaxRows)
# Exact mode's rows per op call (small_rows(); the op's own limit): on a 2-core AVX2 EPYC the op
# over a SmolLM2 step's 121 linears beats the float32 GEMM of the widened weight at every row count
# up to it (16 rows: 59 vs 136 ms with the widening, 64: 208 vs 463; `python -m bench.bench_quant_kernels`).
EXACT_ROWS = OP_ROWS
WIDE_ROWS = 64  # rows from which 8-bit weights with float32 activations take the float32 GEMM
# Rows up to which int4_linear runs the op in chunks of OP_ROWS rows before it widens the weight
# for a GEMM. A SmolLM2 step's linears on a 2-core Zen 4 (`python -m bench.bench_quant_kernels
# --rows 64 128 256 512`): 64-row chunks take 54 / 110 / 220 / 504 ms at 64 / 128 / 256 / 512 rows
# where the weight widened to bf16 per call takes 78 / 124 / 241 / 408; in exact mode 101 / 212 /
# 417 / 859 against 284 / 294 / 617 / 940 widened to float32. Each chunk's rows are computed as
# they would be alone, so a prompt's rows do not depend on what shares its step up to this count.
CHUNKED_ROWS = 256


def small_linear_ops() -> ModuleType | None:
    """The C++ ops when `int4_small_linear` has a vector path here and reads this PyTorch's
    layout, else None."""
    return _small_ops(os.environ.get("ORBITAL_INT4_SMALL_LINEAR", "1") != "0")


@functools.cache
def _small_ops(enabled: bool) -> ModuleType | None:
    # Asked by every int4 linear at decode: computed once.
    if not enabled or pack_layout()[0] != "halves":
        return None
    from engine.kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    return ops if ops is not None and ops.isa() != "generic" else None


@functools.cache
def _bf16_native(ops: ModuleType) -> bool:
    """AVX-512 BF16 with PyTorch's 64-row pack: bf16 dot products in the op, a native bf16 GEMM."""
    return (
        ops.isa() == "avx512_bf16" and pack_layout() == ("halves", 64) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def exact_mode() -> bool:
    """Whether the int4 paths compute with the exact scales and mins and unrounded activations:
    where the op runs but the CPU has no native bf16 (AVX2, AVX-512 without BF16). The op then
    sums q * x in float32 per group (x as the layer has it), and past small_rows() rows the weight
    is widened exactly to float32 for a float32 GEMM (native there, a bf16 one emulated). Both
    are float32 sums of the same exact products, as a float32 model's few-row op and GEMM are,
    so a sequence keeps its greedy tokens through batching and preemption's recompute.
    PyTorch's bf16 kernel, which the AVX2 machine ran before, rounds activations, scales and
    results to bf16, and a request decoded through the op alone and through that kernel in a
    batch parted ways in greedy tokens. Exact GGUF scales are also closer to the file's model."""
    ops = small_linear_ops()
    return ops is not None and not _bf16_native(ops)


def op_scales(weight: torch.Tensor) -> torch.Tensor:
    """What the few-row op reads a weight's groups from: the exact scale and min planes in exact
    mode, else PyTorch's kernel's bf16 (scale, zero) pairs blocked by 64 rows (op_pairs)."""
    return weight.scale_min if exact_mode() else op_pairs(weight)


def op_pairs(weight: torch.Tensor) -> torch.Tensor:
    """`.scales_zeros_bf16`'s values blocked by 64 rows (block_pairs), made on first use and kept
    beside them (PyTorch's kernel and the widening read its own layout). In that layout a one-row
    step reads each group's pairs from another page: on AVX-512 BF16, a Q4_K_M SmolLM2's Q8_0
    head took 1.13 ms at one row against 0.90 blocked, its layers 5.2 against 5.0, and one stream
    decodes 1.05x as fast (`python -m bench.bench_one_stream --against <checkout>`). The copy
    costs 4 bytes per group of a row: 26 MB for that model (~3% of its resident size)."""
    pairs = getattr(weight, "op_pairs", None)
    if pairs is None:
        sz = weight.scales_zeros_bf16
        pairs = block_pairs(sz) if sz.shape[1] % SCALE_ROWS == 0 else sz
        weight.op_pairs = pairs
    return pairs


def wide_gemm_ops() -> ModuleType | None:
    """The C++ ops when prompt-sized steps widen int4 weights to bf16 for oneDNN's GEMM: where the
    few-row op runs (so both read one layout) and the CPU multiplies bf16 natively (AVX-512 BF16;
    elsewhere exact_mode widens to float32). ORBITAL_INT4_WIDE_GEMM=0 turns it off (PyTorch's
    kernel then runs those steps)."""
    return _wide_ops(os.environ.get("ORBITAL_INT4_WIDE_GEMM", "1") != "0")


@functools.cache
def _wide_ops(enabled: bool) -> ModuleType | None:
    ops = small_linear_ops()
    return ops if enabled and ops is not None and _bf16_native(ops) else None


def five_bit_runs() -> bool:
    """Whether a 5-bit weight (nibbles plus high bits) runs here: the few-row op and, past it, the
    widened GEMM (or exact mode's float32 one) read the high bits; else such values are packed as
    two nibbles."""
    return small_linear_ops() is not None and (exact_mode() or wide_gemm_ops() is not None)


def small_rows() -> int:
    """Rows up to which int4_small_linear runs: below WIDE_ROWS where its bf16 dot-product path
    and the widened GEMM run (AVX-512 BF16: a 32-row decode step of SmolLM2 in 63 ms against 90
    through PyTorch's kernel from 17 rows, 48 rows in 98 against 132), else EXACT_ROWS in exact
    mode, else SMALL_ROWS."""
    if wide_gemm_ops() is not None:
        return WIDE_ROWS - 1
    return EXACT_ROWS if exact_mode() else SMALL_ROWS


def _op_rows(ops: ModuleType, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """int4_small_linear over x's rows in chunks of OP_ROWS (into one output), or None where it
    declines. A weight marked by mark_int8_activations takes them rounded to int8."""
    y = x.new_empty(x.shape[0], weight.out_features)
    hi_bits, rows = getattr(weight, "hi_bits", None), pack_layout()[1]
    int8_x = getattr(weight, "int8_activations", False)
    for c in range(0, x.shape[0], OP_ROWS):
        part = slice(c, c + OP_ROWS)
        if not ops.int4_small_linear(x[part], weight, scales, weight.group_size, rows, None, y[part], hi_bits, int8_x):
            return None
    return y


def int8_dot_runs() -> bool:
    """Whether the few-row op takes int8 activations here (kernels/cpu/int4_int8_dot.h: AVX-512
    VNNI, VBMI and BITALG, PyTorch's 64-row pack)."""
    ops = small_linear_ops()
    return ops is not None and pack_layout()[1] == 64 and bool(ops.int8_dot_products())


def mark_int8_activations(model: torch.nn.Module) -> int:
    """The `int8_activations` setting: every packed int4 weight of `model` (4- and 5-bit values,
    8-bit ones as two nibbles) has the few-row op round each activation row to int8 per group and
    multiply with integer dot products, as llama.cpp does (kernels/cpu/int4_int8_dot.h), at every
    row count: in 64-row chunks, prompt-sized steps too (a SmolLM2 step's linears on a 2-core Zen 4
    at 512 rows: 289 ms against 312 widened to bf16 for oneDNN's GEMM, 372 in the bf16 op; 128 rows:
    72, 93, 91). Returns how many weights."""
    if not int8_dot_runs():
        raise ValueError("int8_activations needs AVX-512 VNNI, VBMI and BITALG and the C++ CPU ops")
    marked = set()
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and w.dtype == torch.uint8 and w.is_cpu and hasattr(w, "group_size"):
            w.int8_activations = True
            marked.add(id(w))
    return len(marked)


def _few_rows_op(x2: torch.Tensor, xb: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """int4_small_linear on rows x2 (xb: them in bf16), or None where it does not run."""
    ops = small_linear_ops() if x2.is_cpu else None
    if ops is None:
        return None
    # float32 x: the kernel's bf16 values, result kept float32 (rounding it to bf16 as the
    # kernel does flips some outputs by a bf16 step where the two sums differ in float32).
    xin = xb if x2.dtype == torch.bfloat16 else xb.to(x2.dtype)
    return _op_rows(ops, xin, weight, op_pairs(weight))


def _widened_mm(x: torch.Tensor, weight: torch.Tensor, ops: ModuleType | None, scales=None) -> torch.Tensor | None:
    """x times the packed weight widened once for this call to x's dtype (bf16: the kernel's
    weight rounded; float32: exact, for 8-bit values with float32 activations, as int8.py runs
    int8 weights past its crossover, where the bf16 GEMM cost int8 perplexity +0.3%, and for every
    weight in exact mode, from its exact scales)."""
    if ops is None:
        return None
    wide = torch.empty(x.shape[1], weight.out_features, dtype=x.dtype)
    sz = weight.scales_zeros_bf16 if scales is None else scales
    if not ops.int4_dequantize(weight, sz, weight.group_size, pack_layout()[1], wide, getattr(weight, "hi_bits", None)):
        return None
    return torch.mm(x, wide)


def _exact_linear(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """Exact mode (exact_mode): float32 sums of x (widened to float32 if bf16, exactly) times the
    exact weight, through the op up to CHUNKED_ROWS rows (in chunks of its EXACT_ROWS), else a
    float32 GEMM of the weight widened once; float32 [rows, out_features], or None where the op
    declines."""
    ops = small_linear_ops()
    x32 = x2.float()
    if x2.shape[0] > CHUNKED_ROWS and not getattr(weight, "int8_activations", False):
        return _widened_mm(x32, weight, ops, weight.scale_min)
    return _op_rows(ops, x32, weight, weight.scale_min)


def int4_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """An LM head's logits: through the few-row op in chunks of small_rows() rows where it runs,
    because it keeps its float32 sums, and the other paths round logits to bf16 (ties between
    top tokens, coarse prompt logprobs). Elsewhere int4_linear."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.float32 or small_linear_ops() is None or x2.shape[0] == 0:
        return int4_linear(x, weight)
    step = small_rows()
    if exact_mode():
        parts = [_exact_linear(c, weight) for c in x2.split(step)]
    else:
        parts = [_few_rows_op(c, c.to(torch.bfloat16), weight) for c in x2.split(step)]
    if any(p is None for p in parts):
        return int4_linear(x, weight)
    y = parts[0] if len(parts) == 1 else torch.cat(parts)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def int4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, dequantized weight, bias)` for a packed int4 weight, in x's dtype. In exact mode
    (CPUs without native bf16) _exact_linear; else the C++ op at up to CHUNKED_ROWS rows where the
    widened bf16 GEMM runs past them (wide_gemm_ops; small_rows() elsewhere), else PyTorch's kernel, all with bf16
    activations and PyTorch's bf16 scales and zeros; from WIDE_ROWS, 8-bit (two-nibble) weights
    with float32 activations take a float32 GEMM of the exact weight instead (5-bit ones do not:
    a Q4_K_M file's perplexity moved -0.1% from its float32 model's that way, 0.02% through the
    bf16 GEMM, and its batched steps were 17% slower; `python -m bench.bench_quant`). The kernel runs with bfloat16
    activations at every row count: with float32 ones it takes a ~30x slower path at one row;
    with bf16, on a 3072x576 weight, it is 1.3 ms at 64 rows (float32 GEMM 1.8, dequantize +
    float32 GEMM 14.7) and 46.6 ms at 2048 (43.5, 49.9)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    y = None
    if x2.is_cpu and x2.shape[0] > 0 and exact_mode():
        y = _exact_linear(x2, weight)
    wide_rows = x2.shape[0] >= WIDE_ROWS and x2.is_cpu
    int8_x = getattr(weight, "int8_activations", False)  # the op at every row count (mark_int8_activations)
    if y is None and wide_rows and weight.two_nibbles and x2.dtype == torch.float32 and not int8_x:
        y = _widened_mm(x2, weight, small_linear_ops(), weight.scale_min)  # 8-bit values, float32 activations
        if y is not None:
            if bias is not None:
                y += bias
            return y.reshape(*x.shape[:-1], y.shape[-1])
    if y is None:
        xb = x2.to(torch.bfloat16)
        wide = wide_gemm_ops()  # asked once per call: it reads the environment
        op_limit = x2.shape[0] if int8_x else CHUNKED_ROWS if wide is not None else small_rows()
        y = _few_rows_op(x2, xb, weight) if 0 < x2.shape[0] <= op_limit else None
        if y is None and wide_rows:
            y = _widened_mm(xb, weight, wide)
        if y is None and getattr(weight, "hi_bits", None) is not None:  # packed where five_bit_runs() held
            y = torch.mm(xb, dequantize_int4(weight, torch.bfloat16).t())  # PyTorch's kernel reads no high bits
        if y is None:
            if weight.two_nibbles:
                xb = torch.cat([xb, xb], dim=-1)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, weight, weight.group_size, weight.scales_zeros_bf16)
            y = y if y.shape[1] == weight.out_features else y[:, : weight.out_features]
    y = y.to(x.dtype)  # the bias after, as every path rounds to x's dtype first
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], y.shape[-1])
