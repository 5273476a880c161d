"""Quantized-weight kernels over one decode step's linears of the embedded model (every layer's
qkv, o, gate_up and down plus the LM head; one weight set per layer, so weights come from
memory): the packed float32 GEMM, int8 (`_weight_int8pack_mm` up to 32 rows), PyTorch's int4
kernel with float32 and with bfloat16 activations, the few-row C++ int4 op (int4_linear.cpp, up
to its 64-row limit; bf16 activations with PyTorch's bf16 scales, in its layout and blocked by 64
rows as int4_linear runs it on AVX-512 BF16 (int4.op_pairs), the same on int8 activations (the
int8_activations setting, where AVX-512 VNNI runs it), and with the exact ones: float16 as a GGUF's are, float32 as int4 from float
weights has them; float32 activations with float16 scales, as exact mode runs it), the weight
widened per call (float32 from the exact scales, exact mode; bf16 on AVX-512 BF16), the op in
chunks of 64 rows past its limit, and dequantize + float32 GEMM. Median ms per step.

    python -m bench.bench_quant_kernels --group 32 --rows 1 4 16 32 64 128 256 512
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.timing import median_time
from engine.kernels.cpu_ops import load_cpu_ops
from engine.layers.packed_gemm import linear, pack_weight
from engine.layers.quant.int4 import op_pairs
from engine.layers.quant.int4_format import (
    dequantize_int4,
    pack_int4,
    pack_layout,
    quantize_int4,
    scale_planes,
    unpack_nibbles,
)
from engine.layers.quant.int8 import int8_linear, quantize_int8

OP_ROWS = 64  # the few-row op's limit (int4_linear.cpp kMaxRows): timed up to it to find crossovers


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 32, 64, 128, 256])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # SmolLM2-135M
    ws = [torch.randn(n, k) * 0.02 for n, k in shapes]
    packed = [pack_weight(w) for w in ws]
    i8 = [quantize_int8(w) for w in ws]
    i4 = [quantize_int4(w, a.group) for w in ws]
    i4_f16 = [f16_scales(w) for w in i4]
    for w in i4:
        op_pairs(w)  # made on first use as int4_linear does: here before timing
    int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    ops = load_cpu_ops()
    for m in a.rows:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        xb = {k: x.bfloat16() for k, x in xs.items()}
        r = {  # seconds
            "f32 packed": median_time(
                lambda: [linear(xs[w.shape[1] if not w.is_mkldnn else k], w) for w, (n, k) in zip(packed, shapes)],
                a.reps,
            ),
            "int8": median_time(lambda: [int8_linear(xs[k], w) for w, (n, k) in zip(i8, shapes)], a.reps),
            "int4 bf16 act": median_time(
                lambda: [int4_mm(xb[k], w, w.group_size, w.scales_zeros_bf16) for w, (n, k) in zip(i4, shapes)], a.reps
            ),
        }
        if m <= 4:
            r["int4 f32 act"] = median_time(
                lambda: [int4_mm(xs[k], w, w.group_size, w.scales_zeros_bf16.float()) for w, (n, k) in zip(i4, shapes)],
                1,
            )
        if m <= OP_ROWS:
            block = pack_layout()[1]
            columns = {  # the op's scales: PyTorch's bf16 pairs (int4_linear on AVX-512 BF16), exact ones
                "int4 op bf16 pairs": (i4, "scales_zeros_bf16", xb, False),
                "int4 op bf16 pairs blocked": (i4, "op_pairs", xb, False),
                "int4 op f16 scales": (i4_f16, "scale_min", xb, False),
                "int4 op f32 scales": (i4, "scale_min", xb, False),
                "int4 op exact f32 x": (i4_f16, "scale_min", xs, False),  # exact mode (int4.exact_mode)
                # the int8_activations setting (int4_int8_dot.h), as int4_linear runs it on AVX-512 BF16
                "int4 op int8 activations": (i4, "op_pairs", xb, True),
            }
            for name, (weights, attr, x, int8_x) in columns.items():
                op = ops.int4_small_linear if ops is not None else None
                outs = [torch.empty(m, n, dtype=x[576].dtype) for n, k in shapes]
                w0 = weights[0]
                if op is not None and op(x[576], w0, getattr(w0, attr), a.group, block, None, outs[0], None, int8_x):
                    r[name] = median_time(
                        lambda ws=weights, at=attr, x=x, outs=outs, i8=int8_x: [
                            op(x[k], w, getattr(w, at), a.group, block, None, o, None, i8)
                            for w, (n, k), o in zip(ws, shapes, outs)
                        ],
                        a.reps,
                    )
        if m > OP_ROWS and ops is not None and ops.isa() != "generic":
            # The op over a prompt-sized step in chunks of its 64 rows (each chunk as it runs alone).
            block = pack_layout()[1]
            for name, (weights, attr, x) in {
                "int4 op bf16 pairs, 64-row chunks": (i4, "scales_zeros_bf16", xb),
                "int4 op exact f32 x, 64-row chunks": (i4_f16, "scale_min", xs),
            }.items():
                outs = [torch.empty(m, n, dtype=x[576].dtype) for n, k in shapes]
                r[name] = median_time(
                    lambda ws=weights, at=attr, x=x, outs=outs: [
                        ops.int4_small_linear(
                            x[k][c : c + OP_ROWS], w, getattr(w, at), a.group, block, None, o[c : c + OP_ROWS]
                        )
                        for w, (n, k), o in zip(ws, shapes, outs)
                        for c in range(0, m, OP_ROWS)
                    ],
                    a.reps,
                )
        if m >= 16:
            r["dequant+f32"] = median_time(
                lambda: [F.linear(xs[k], dequantize_int4(w)) for w, (n, k) in zip(i4, shapes)], 3
            )
            # The bf16 GEMM alone over the int4 weights widened beforehand: what widening per
            # call could reach at large steps with a dequantize that costs next to nothing.
            wide = [dequantize_int4(w, torch.bfloat16) for w in i4]
            r["bf16 GEMM of widened int4"] = median_time(
                lambda: [F.linear(xb[k], w) for w, (n, k) in zip(wide, shapes)], a.reps
            )
            del wide
            if ops is not None and ops.isa() != "generic":
                # exact mode past its op rows: the weight widened exactly to float32 per call
                r["int4 widened f32 per call"] = median_time(
                    lambda: [widened_linear(ops, xs[k], w, w.scale_min) for w, (n, k) in zip(i4_f16, shapes)], a.reps
                )
            if ops is not None and ops.isa() == "avx512_bf16":
                # What int4_linear runs from WIDE_ROWS: the weight widened per call, then that GEMM.
                r["int4 widened per call"] = median_time(
                    lambda: [widened_linear(ops, xb[k], w) for w, (n, k) in zip(i4, shapes)], a.reps
                )
        print(f"rows {m}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r.items()), flush=True)


def widened_linear(ops, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    wide = torch.empty(x.shape[1], w.out_features, dtype=x.dtype)
    ops.int4_dequantize(w, w.scales_zeros_bf16 if scales is None else scales, w.group_size, pack_layout()[1], wide)
    return torch.mm(x, wide)


def f16_scales(w: torch.Tensor) -> torch.Tensor:
    """The same int4 weight with float16 scales and mins (as a GGUF's), which it then stores so."""
    n = w.out_features
    scale, minimum = (t.t()[:n].half().float() for t in scale_planes(w.scale_min))
    return pack_int4(unpack_nibbles(w.data)[:n], scale, minimum, w.group_size)


if __name__ == "__main__":
    main()
