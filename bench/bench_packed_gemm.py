"""F.linear vs oneDNN-packed weights over one decode step's linears, side by side.

The embedded model's shapes (every layer's qkv, o, gate_up and down projections plus the LM
head), one weight set per layer so weights come from memory as in a real step, not from cache.
Prints the median time of each path per row count and the ratio.

    python -m bench.bench_packed_gemm --dtypes bfloat16 float32 --rows 16 48 128 256 2048
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from bench.timing import median_time
from engine.layers.packed_gemm import linear, pack_weight


def model_shapes(cfg) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    hd = cfg.hidden_size // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
    h, f = cfg.hidden_size, cfg.intermediate_size
    return [(h, qkv), (cfg.num_attention_heads * hd, h), (h, 2 * f), (f, h)], (h, cfg.vocab_size)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--rows", nargs="+", type=int, default=[16, 48, 128, 256, 2048])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    from engine.model.loader import resolve_model_dir

    cfg = AutoConfig.from_pretrained(resolve_model_dir(None))
    layer_shapes, head_shape = model_shapes(cfg)
    print("| dtype | rows | F.linear ms | packed ms | speedup |\n|---|---|---|---|---|")
    for name in args.dtypes:
        dt = getattr(torch, name)
        g = torch.Generator().manual_seed(0)
        plain = [torch.randn(n, k, generator=g).to(dt) * 0.02 for _ in range(cfg.num_hidden_layers) for k, n in layer_shapes]
        plain.append(torch.randn(head_shape[1], head_shape[0], generator=g).to(dt) * 0.02)
        packed = [pack_weight(w) for w in plain]
        for m in args.rows:
            xs = {k: torch.randn(m, k, dtype=dt) for k in {w.shape[1] for w in plain}}
            a_runs, b_runs = [], []
            for _ in range(2):  # alternate the two paths so drift on a noisy host hits both
                a_runs.append(median_time(lambda: [F.linear(xs[w.shape[1]], w) for w in plain], args.reps))
                b_runs.append(median_time(lambda: [linear(xs[w.shape[1]], w) for w in packed], args.reps))
            a, b = statistics.median(a_runs), statistics.median(b_runs)
            print(f"| {name} | {m} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
