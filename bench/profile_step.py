"""Where one engine step's time goes: GPU kernels by kind and the host's work around them.

For each model shape and case (a decode step of B rows at a context of --context tokens, or one
prompt of --prefill-len tokens), the engine (CUDA graphs on) runs the case, then --steps more
steps are timed, first under the PyTorch profiler and then with plain timers:

- GPU: the profiler's kernels summed by kind: GEMM (cuBLAS/cuBLASLt/CUTLASS), attention (the
  Triton paged kernel), and the rest (norms, rotary, SiLU-and-mul, argmax...). Busy time is
  their sum; a step's wall time minus busy time is when the GPU sat idle (host work, launch gaps).
- Host: `schedule`, the runner's `launch_model` (inputs, graph replay or eager launches, logits
  and sampling queued), the wait for the sampled ids with the step's bookkeeping, the scheduler's
  `update_from_output`, and the text side (`process_outputs`: detokenizing, stop strings), each
  wrapped with a timer here (bench instrumentation, nothing in the engine).

The shares of the machine's limits: a decode step reads every weight once, so its floor is
weight bytes / memory bandwidth (--bandwidth-gbs, the GPU's datasheet figure); a batch's GEMM
FLOPs / step time against --peak-tflops gives the tensor-core share.

    python -m bench.profile_step --models llama-1b llama-8b --out profile.json   # needs CUDA
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import statistics
import time

import torch

from bench.bench_gpu import weight_bytes
from bench.random_llama import model_dir


def kernel_kind(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemm", "gemv", "cutlass", "nvjet", "cublas", "sm90_xmma", "sm80_xmma", "splitk")):
        return "gemm"
    if "paged_attention" in n or "attn" in n or "flash" in n:
        return "attention"
    return "other"


class Timers:
    """Wraps methods of the engine's objects with wall-clock timers (bench only)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = collections.defaultdict(list)

    def wrap(self, obj, name: str, key: str) -> None:
        f = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            r = f(*a, **k)
            self.times[key].append(time.perf_counter() - t)
            return r

        setattr(obj, name, timed)

    def wrap_result(self, obj, name: str, key: str) -> None:
        """Like wrap, for a method returning a call: the call is timed under `key`."""
        f = getattr(obj, name)

        def launched(*a, **k):
            done = f(*a, **k)

            def timed_done():
                t = time.perf_counter()
                r = done()
                self.times[key].append(time.perf_counter() - t)
                return r

            return timed_done

        setattr(obj, name, launched)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_case(
    llm, timers: Timers, prompts: list[list[int]], decode: bool, steps: int, device: str, trace: str | None = None
) -> dict:
    """Adds the requests, runs them to the measured state, then `steps` profiled and `steps`
    timed steps. Decode: every request in decode before measuring. Prefill: one step each."""
    from engine import SamplingParams

    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=3 * steps + 8 if decode else 1, ignore_eos=True)

    def start():
        ids = {eng.add_request(None, {"prompt_token_ids": p}, sp) for p in prompts}
        while decode and ids:  # until every request has its first token: all rows decode
            for out in eng.step():
                if out.outputs[0].token_ids:
                    ids.discard(out.request_id)

    def finish():
        while eng.has_unfinished_requests():
            eng.step()

    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    if decode:
        start()
    _sync(device)
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        n = 0
        for _ in range(steps):
            if not decode:
                start()
            eng.step()
            n += 1
            if not decode:
                finish()
        _sync(device)
        prof_wall = (time.perf_counter() - t0) / n
    kinds: dict[str, float] = collections.defaultdict(float)
    for e in prof.key_averages():  # kernels are rows of their own, on the CUDA device
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kinds[kernel_kind(e.key)] += e.self_device_time_total / 1e3  # us -> ms
    kinds = {k: v / n for k, v in kinds.items()}
    if trace:
        prof.export_chrome_trace(trace)
    finish()
    # Plain timers (no profiler), the same number of steps. Decode: the mean of steps run back
    # to back (an overlapped step ends while the next one runs on the GPU).
    if decode:
        start()
        _sync(device)
        timers.times.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        _sync(device)
        walls = [(time.perf_counter() - t0) / steps]
        finish()
    else:
        timers.times.clear()
        walls = []
        for _ in range(steps):
            start()
            _sync(device)
            t0 = time.perf_counter()
            eng.step()
            finish()
            _sync(device)
            walls.append(time.perf_counter() - t0)
    host = {k: 1e3 * statistics.median(v) for k, v in timers.times.items() if v}
    return {
        "wall_ms": 1e3 * statistics.median(walls),
        "profiled_wall_ms": 1e3 * prof_wall,
        "gpu_ms": dict(kinds),
        "gpu_busy_ms": sum(kinds.values()),
        "host_ms": host,
    }


def profile_model(shape: str, overlap: str, args) -> list[dict]:
    from engine import LLM

    path = model_dir(args.model_dir, shape, getattr(torch, args.dtype), args.device)
    llm = LLM(
        path,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(args.prefill_len, 2048),
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False,
        **({"overlap_text": overlap == "on"} if overlap != "auto" else {}),
    )
    runner = llm.engine.core.executor.runner
    # What a decode step reads: every linear weight and the LM head (the embedding's when tied).
    hf = runner.mc.hf_config
    mats = {n: p for n, p in runner.model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n}
    linear_params = sum(p.numel() for p in mats.values())
    if not any("lm_head" in n for n in mats):
        linear_params += hf.vocab_size * hf.hidden_size
    elt = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    wbytes = linear_params * elt
    linear_flops_per_token = 2 * linear_params
    timers = Timers()
    core = llm.engine.core
    timers.wrap(core.scheduler, "schedule", "schedule")
    timers.wrap(core.scheduler, "update_from_output", "update")
    if hasattr(core.executor, "launch_model"):
        timers.wrap_result(core.executor, "launch_model", "wait+bookkeeping")
        timers.wrap(core.executor, "launch_model", "launch")
    else:  # an engine without launched steps: the whole model step under "launch"
        timers.wrap(core.executor, "execute_model", "launch")
    timers.wrap(llm.engine.outputs, "process_outputs", "text")
    rows = []
    cases = [("decode", b) for b in args.batches] + [("prefill", args.prefill_len)]
    for kind, size in cases:
        if kind == "decode":
            prompts = [[(7 * i + j) % 1000 + 1 for j in range(args.context)] for i in range(size)]
        else:
            prompts = [[(3 * j) % 1000 + 1 for j in range(size)]]
        run_case(llm, timers, prompts, kind == "decode", 3, args.device)  # warm-up
        trace = f"{args.trace_dir}/{shape}-{kind}-{size}.json" if args.trace_dir else None
        r = run_case(llm, timers, prompts, kind == "decode", args.steps, args.device, trace)
        tokens = size
        floor_ms = 1e3 * wbytes / (args.bandwidth_gbs * 1e9)
        r.update(
            model=shape,
            overlap=overlap,
            case=f"{kind} {size}",
            weight_gb=wbytes / 1e9,
            all_weight_gb=weight_bytes(runner.model) / 1e9,
            bandwidth_floor_ms=floor_ms,
            floor_share=floor_ms / r["wall_ms"],
            linear_tflops=linear_flops_per_token * tokens / (r["wall_ms"] / 1e3) / 1e12,
        )
        r["tensor_core_share"] = r["linear_tflops"] / args.peak_tflops
        rows.append(r)
        print(json.dumps(r), flush=True)
    del llm, runner, core, timers  # the timers' closures hold the engine's objects
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    host_keys = ["schedule", "launch", "wait+bookkeeping", "update", "text"]
    lines = [
        "| model | overlap | case | step ms | GPU busy ms (GEMM · attention · other) | GPU idle ms | host ms ("
        + " · ".join(host_keys)
        + ") | bandwidth floor ms (share) | linear TFLOP/s (share) |",
        "|---|---|---|---:|---|---:|---|---|---|",
    ]
    for r in rows:
        g, h = r["gpu_ms"], r["host_ms"]
        lines.append(
            f"| {r['model']} | {r['overlap']} | {r['case']} | {r['wall_ms']:.2f} | {r['gpu_busy_ms']:.2f} ("
            + " · ".join(f"{g.get(k, 0):.2f}" for k in ("gemm", "attention", "other"))
            + f") | {max(0.0, r['wall_ms'] - r['gpu_busy_ms']):.2f} | "
            + " · ".join(f"{h.get(k, 0):.2f}" for k in host_keys)
            + f" | {r['bandwidth_floor_ms']:.2f} ({100 * r['floor_share']:.0f}%) | "
            f"{r['linear_tflops']:.1f} ({100 * r['tensor_core_share']:.1f}%) |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.profile_step", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", nargs="+", default=["llama-1b", "llama-8b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 256])
    ap.add_argument("--context", type=int, default=128, help="tokens cached per decode row")
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--overlap", nargs="+", choices=["auto", "on", "off"], default=["off", "on"], help="engine's overlap_text"
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="default: H200 4800, H100 SXM 3350")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 (H100/H200 SXM: 989)")
    ap.add_argument("--model-dir", default=None, help="build the random models here once and reuse them")
    ap.add_argument("--trace-dir", default=None, help="write each case's Chrome trace here (keep traces out of git)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    if args.bandwidth_gbs is None:
        args.bandwidth_gbs = 4800.0 if "H200" in name else 3350.0
    rows = [r for m in args.models for o in args.overlap for r in profile_model(m, o, args)]
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": name, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
