"""Benchmark (a): sweep closed-loop concurrency on the mixed workload.

    python -m loadtest.bench_concurrency --server-cmd "<command that serves the embedded model>" \
        --base-url http://127.0.0.1:8000

Without ``--server-cmd`` it measures a server already listening at ``--base-url``. Writes
``<out-dir>/sweep.json``, one result file per point, ``sweep.png`` (TTFT/TPOT/throughput vs
concurrency), ``latency_cdf.png`` and ``table.md`` (the table in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os

from loadtest import plots, workloads
from loadtest.client import ClientConfig
from loadtest.metrics import SLO
from loadtest.result import load
from loadtest.server import ServerProcess
from loadtest.sweep import sweep, sweep_table
from loadtest.tokens import TokenCounter, embedded_gguf_path, load_counter


def bench_args(p: argparse.ArgumentParser) -> None:
    """Options both bench scripts share."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for the server")
    p.add_argument("--model", default=None)
    p.add_argument("--tokenizer", default="smollm2", help="'smollm2', a .gguf, an HF dir, or 'approx'")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request bound, seconds")
    p.add_argument("--duration", type=float, default=600.0, help="per run: stop sending after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ignore-eos", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def counter_for(name: str) -> TokenCounter:
    if name == "approx" or (name in ("smollm2", "default") and embedded_gguf_path() is None):
        return TokenCounter()
    return load_counter(name)


def client_for(a, base_url: str | None = None) -> ClientConfig:
    return ClientConfig(
        base_url=base_url or a.base_url, model=a.model, timeout=a.timeout, ignore_eos=not a.no_ignore_eos
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_args(p)
    p.add_argument("--server-cmd", default=None, help="start this server first (stopped at the end)")
    p.add_argument("--values", default="1,2,4,8,16,32,64", help="concurrencies")
    p.add_argument("--num-requests", type=int, default=16, help="at least this many requests per point")
    p.add_argument("--requests-per-unit", type=int, default=4, help="... and at least this x concurrency")
    p.add_argument("--output-tokens", type=int, default=None, help="cap every output length (short runs)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--out-dir", default="loadtest-results/bench_concurrency")
    a = p.parse_args(argv)

    counter = counter_for(a.tokenizer)
    cfg = client_for(a)
    wl = workloads.WorkloadConfig("mixed", seed=a.seed, output_tokens=a.output_tokens)

    def specs_for(c: float):
        wl.num_requests = max(a.num_requests, int(a.requests_per_unit * c))
        return workloads.build(wl, counter)

    values = [float(v) for v in a.values.split(",")]
    config = {
        "client": {"base_url": a.base_url, "model": a.model, "ignore_eos": cfg.ignore_eos},
        "workload": {"name": "mixed", "seed": a.seed, "tokenizer": counter.name, "output_tokens": a.output_tokens},
        "bench": "concurrency",
        "server_cmd": a.server_cmd,
    }
    os.makedirs(a.out_dir, exist_ok=True)
    with ServerProcess(a.server_cmd, cfg.root, a.server_timeout, os.path.join(a.out_dir, "server.log")):
        res = sweep(
            specs_for,
            cfg,
            "concurrency",
            values,
            SLO(a.slo_ttft_ms, a.slo_tpot_ms),
            config,
            a.out_dir,
            seed=a.seed,
            label="mixed",
            max_duration=a.duration,
            progress=not a.no_progress,
        )
    table = sweep_table(res)
    with open(os.path.join(a.out_dir, "table.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    plots.sweep_plot(res, os.path.join(a.out_dir, "sweep.png"))
    results = [load(os.path.join(a.out_dir, pt["result_file"])) for pt in res["points"]]
    plots.latency_cdfs(results, os.path.join(a.out_dir, "latency_cdf.png"))
    print(f"\nwritten to {a.out_dir}/: sweep.json, table.md, sweep.png, latency_cdf.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
