"""Quantized-weight GEMMs on CUDA against cuBLAS at bf16, side by side in one run, and the tuner
of the Triton kernels' tile shapes (triton_tiles.py).

A step is the linears of a model's forward (--layers layers' qkv, o, gate_up, down and the LM
head, one weight set per layer so the weights come from memory, not L2) at one row count. Each
step is captured in a CUDA graph and replayed (GPU time: Triton's Python launches cost more
than these kernels take), median of --reps replays. Per row count: bf16 `F.linear`, int4 g32
through the Triton kernel (the best tile of the candidates, with --tune; else the table's) and
through tinygemm, int8 through the Triton kernel and widened per call; ratios to bf16 (above 1:
faster). --tune saves the best tiles as this GPU's table (engine/layers/quant/tuned/).

    python -m bench.bench_gpu_quant_kernels --tune --rows 1 16 32 64 128 512 2048
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from bench.random_llama import SHAPES
from engine.layers.quant.triton_tiles import Tile, save_table

BASELINES = {"int4": "int4 tinygemm", "int8": "int8 widened"}


def candidates(m: int) -> list[Tile]:
    if m <= 16:
        return [Tile(16, bn, bk) for bn in (32, 64, 128) for bk in (128, 256)] + [Tile(16, 64, 128, split=False)]
    if m <= 64:
        return [Tile(m if m > 16 else 32, bn, bk) for bn in (64, 128) for bk in (64, 128)]
    return [Tile(bm, 128, 64, w) for bm in (64, 128) for w in (4, 8)] + [Tile(64, 128, 128), Tile(128, 128, 128, 8)]


def step_shapes(shape: str, layers: int) -> list[tuple[int, int]]:
    c = SHAPES[shape]
    h, i = c["hidden_size"], c["intermediate_size"]
    qkv = h + 2 * c["num_key_value_heads"] * (h // c["num_attention_heads"])
    return [(qkv, h), (h, h), (2 * i, h), (h, i)] * layers + [(49152, h)]


def weights(kind: str, shapes, torch_kernel: bool) -> list[torch.Tensor]:
    from engine.layers.quant.cuda_int4 import pack_int4_cuda
    from engine.layers.quant.int4_format import quantize_groups
    from engine.layers.quant.int8 import quantize_int8

    os.environ["ORBITAL_CUDA_QUANT_KERNEL"] = "torch" if torch_kernel else "triton"
    out = []
    for n, k in shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        out.append(
            pack_int4_cuda(*quantize_groups(w, 32), 32) if kind == "int4" else quantize_int8(w) if kind == "int8" else w
        )
    return out


def time_step(fn, reps: int) -> float:
    fn()  # Triton compiles, cuBLAS picks
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times)


def main(argv=None) -> None:
    from engine.layers.packed_gemm import linear
    from engine.layers.quant.triton_weight_gemm import int4_matmul, int8_matmul

    ap = argparse.ArgumentParser(prog="python -m bench.bench_gpu_quant_kernels", description=__doc__)
    ap.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 16, 32, 64, 128, 512, 2048])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tune", action="store_true", help="try the candidate tiles and save the best as this GPU's")
    ap.add_argument("--out", default=None, help="also write the tuned table here")
    args = ap.parse_args(argv)
    shapes = step_shapes(args.shape, args.layers)
    name = torch.cuda.get_device_name()
    print(f"{name}, {args.shape}: {len(shapes)} linears per step, median ms of {args.reps} graph replays", flush=True)
    torch.manual_seed(0)
    times: dict[str, dict[int, float]] = {}
    best: dict[str, dict[int, Tile]] = {"int4": {}, "int8": {}}
    for kind in ("bf16", "int4", "int8"):
        for torch_kernel in (False, True) if kind != "bf16" else (True,):
            label = kind if kind == "bf16" else BASELINES[kind] if torch_kernel else f"{kind} triton"
            ws = weights(kind, shapes, torch_kernel)
            times[label] = {}
            for m in args.rows:
                xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for k in {k for _, k in shapes}}
                if kind == "bf16" or torch_kernel or not args.tune:
                    times[label][m] = time_step(lambda: [linear(xs[k], w) for w, (_, k) in zip(ws, shapes)], args.reps)
                    continue
                run = {"int4": lambda w, x, t: int4_matmul(x, w, w.scale_min, 32, w.out_features, None, w.centered, t),
                       "int8": lambda w, x, t: int8_matmul(x, w, w.scale, None, t)}[kind]  # fmt: skip
                tried = {}
                (_, k0), w0 = shapes[0], ws[0]
                want = run(w0, xs[k0], None).float()  # the default tile's result
                for tile in candidates(m):
                    try:
                        got = run(w0, xs[k0], tile).float()
                        if ((got - want).norm() / want.norm()).item() > 1e-2:
                            print(f"  {kind} m={m} {tile}: WRONG result, skipped", flush=True)
                            continue
                        tried[tile] = time_step(
                            lambda: [run(w, xs[k], tile) for w, (_, k) in zip(ws, shapes)], args.reps
                        )
                    except Exception as e:  # a tile past the shared memory or registers: skipped
                        print(f"  {kind} m={m} {tile}: {type(e).__name__}", flush=True)
                tile = min(tried, key=tried.get)
                best[kind][m], times[label][m] = tile, tried[tile]
                print(f"  {kind} m={m}: {tried[tile]:.3f} ms with {tile} ({len(tried)} tried)", flush=True)
            ws = None  # frees the weights before the next kind
            torch.cuda.empty_cache()
    if args.tune:
        path = save_table(name, best)
        print(f"tuned tiles -> {path}")
        if args.out:
            import shutil

            shutil.copy(path, args.out)
    print("| kernel | " + " | ".join(f"{m} rows" for m in args.rows) + " |")
    print("|---|" + "---:|" * len(args.rows))
    for label, r in times.items():
        cells = [f"{r[m]:.3f} ms ({times['bf16'][m] / r[m]:.2f}x)" for m in args.rows]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
