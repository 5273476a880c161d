"""GGUF 5-bit values (Q5_0-like: -16..15 and a float16 scale per 32 inputs) through the few-row
int4 op, held as two nibbles (8 bits a weight, two passes over the inputs) and as nibbles plus a
high-bit plane (5 bits a weight): the qkv, o and gate_up linears of every SmolLM2-135M layer
(90 weights, one set per layer, so they come from memory), with bf16 activations and PyTorch's
bf16 scales (as int4_linear runs the op on AVX-512 BF16) and with float32 activations and the
exact scales (exact mode). Median ms per step and the ratio.

    python -m bench.bench_five_bits --rows 1 4 8 32
"""

from __future__ import annotations

import argparse

import torch

from bench.timing import median_time
from engine.kernels.cpu_ops import load_cpu_ops
from engine.layers.quant.blocks import BlockQuantized
from engine.layers.quant.int4_format import pack_int4, pack_layout

SHAPES = [(960, 576), (576, 576), (3072, 576)] * 30  # SmolLM2-135M's Q5_0 tensors in a Q4_K_M file


def q5_0_weights(seed: int = 0) -> list[BlockQuantized]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k in SHAPES:
        q = torch.randint(-16, 16, (n, k), generator=g, dtype=torch.int8)
        d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half().float()
        out.append(BlockQuantized(q, d, torch.zeros_like(d), 8, "Q5_0"))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    ops = load_cpu_ops()
    if ops is None or ops.isa() == "generic":
        print("the C++ int4 op has no vector path here")
        return
    blocks = q5_0_weights()
    two = [pack_int4(*b.as_nibbles(True), 32, split=True) for b in blocks]
    five = []
    for b in blocks:
        nibbles, hi_bits, scale, minimum = b.as_five_bits()
        five.append(pack_int4(nibbles, scale, minimum, 32, hi_bits=hi_bits))
    rows = pack_layout()[1]
    print(f"C++ ops: {ops.isa()}, pack rows {rows}, {a.threads} threads")
    for label, dtype, scales in (
        ("bf16 x, bf16 scales", torch.bfloat16, "scales_zeros_bf16"),
        ("f32 x, exact", torch.float32, "scale_min"),
    ):
        for m in a.rows:
            x = torch.randn(m, 576).to(dtype)
            outs = [torch.empty(m, n, dtype=dtype) for n, _ in SHAPES]

            def step(ws):
                for w, o in zip(ws, outs):
                    ops.int4_small_linear(x, w, getattr(w, scales), 32, rows, None, o, w.hi_bits)

            t2, t5 = median_time(lambda: step(two), a.reps), median_time(lambda: step(five), a.reps)
            print(
                f"{label}, rows {m}: two nibbles {t2 * 1e3:.2f} ms, 5-bit {t5 * 1e3:.2f} ms, {t2 / t5:.2f}x", flush=True
            )


if __name__ == "__main__":
    main()
