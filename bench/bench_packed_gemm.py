"""F.linear vs oneDNN-packed weights (vs the few-row C++ op) over one decode step's linears.

The embedded model's shapes (every layer's qkv, o, gate_up and down projections plus the LM
head), one weight set per layer so weights come from memory as in a real step, not from cache.
Prints the median time of each path per row count and the ratios. At rows <= SMALL_ROWS the
`linear` path takes the few-row op (small_linear.cpp) where it has a vector path; the column
"oneDNN" is the packed GEMM alone there.

    python -m bench.bench_packed_gemm --dtypes bfloat16 float32 --rows 1 4 16 48 128 256 2048
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from bench.timing import median_time
from engine.layers.packed_gemm import SMALL_ROWS, linear, pack_weight, packing_enabled


def model_shapes(cfg) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    hd = cfg.hidden_size // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
    h, f = cfg.hidden_size, cfg.intermediate_size
    return [(h, qkv), (cfg.num_attention_heads * hd, h), (h, 2 * f), (f, h)], (h, cfg.vocab_size)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 48, 128, 256, 2048])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    from engine.model.loader import resolve_model_dir

    cfg = AutoConfig.from_pretrained(resolve_model_dir(None))
    layer_shapes, head_shape = model_shapes(cfg)
    print(
        "| dtype | rows | F.linear ms | oneDNN packed ms | orbital linear ms | vs F.linear | vs oneDNN |\n"
        "|---|---|---|---|---|---|---|"
    )
    for name in args.dtypes:
        dt = getattr(torch, name)
        g = torch.Generator().manual_seed(0)
        plain = [
            torch.randn(n, k, generator=g).to(dt) * 0.02 for _ in range(cfg.num_hidden_layers) for k, n in layer_shapes
        ]
        plain.append(torch.randn(head_shape[1], head_shape[0], generator=g).to(dt) * 0.02)
        # Without oneDNN bf16 (AVX2-only CPUs) the engine keeps plain weights: F.linear, and the
        # few-row op at few rows.
        packs = packing_enabled(dt, torch.device("cpu"))
        packed = [pack_weight(w) for w in plain] if packs else plain
        onednn = [pack_weight(w) for w in plain] if packs else None
        for w in onednn or []:
            w.plain = None  # the packed GEMM alone
        for m in args.rows:
            xs = {k: torch.randn(m, k, dtype=dt) for k in {w.shape[1] for w in plain}}
            a_runs, b_runs, c_runs = [], [], []
            for _ in range(2):  # alternate the paths so drift on a noisy host hits all alike
                a_runs.append(median_time(lambda: [F.linear(xs[w.shape[1]], w) for w in plain], args.reps))
                if m <= SMALL_ROWS and onednn:
                    b_runs.append(median_time(lambda: [linear(xs[w.shape[1]], w) for w in onednn], args.reps))
                c_runs.append(median_time(lambda: [linear(xs[w.shape[1]], w) for w in packed], args.reps))
            a, c = statistics.median(a_runs), statistics.median(c_runs)
            if not packs:
                print(f"| {name} | {m} | {a * 1e3:.1f} | - | {c * 1e3:.1f} | {a / c:.2f}x | - |", flush=True)
                continue
            b = statistics.median(b_runs) if b_runs else c
            print(
                f"| {name} | {m} | {a * 1e3:.1f} | {b * 1e3:.1f} | {c * 1e3:.1f} | {a / c:.2f}x | {b / c:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
