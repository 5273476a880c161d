"""Benchmark (b): prefix caching on vs off on the shared-prefix workload.

    python -m loadtest.bench_prefix_cache \
        --server-cmd-on  "<serve the embedded model with prefix caching>" \
        --server-cmd-off "<the same with prefix caching disabled>"

Each server is started in turn at ``--base-url`` (or, without commands, two running servers at
``--base-url`` and ``--base-url-off`` are measured). Reports TTFT p50/p99 and the hit rate (the
server's /metrics prefix-cache counters, else usage ``cached_tokens``). Writes ``on.json``,
``off.json``, ``table.md`` and ``compare_latency_cdf.png`` under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import os

from loadtest import plots, workloads
from loadtest.arrivals import ClosedLoop
from loadtest.bench_concurrency import bench_args, client_for, counter_for
from loadtest.compare import hit_rate, render
from loadtest.metrics import SLO
from loadtest.result import save
from loadtest.server import ServerProcess
from loadtest.sweep import measure


def summary_table(on: dict, off: dict) -> str:
    rows = [
        "| prefix caching | TTFT p50 ms | TTFT p99 ms | E2E p50 ms | output tok/s | hit rate |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in (("on", on), ("off", off)):
        a, h = r["aggregates"], hit_rate(r)
        f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        rows.append(
            f"| {name} | {f(a['ttft_ms']['p50'])} | {f(a['ttft_ms']['p99'])} | {f(a['e2e_ms']['p50'])} "
            f"| {a['output_tok_s']:.1f} | {'-' if h is None else f'{100 * h:.1f}%'} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_args(p)
    p.add_argument("--server-cmd-on", default=None, help="server with prefix caching (started, then stopped)")
    p.add_argument("--server-cmd-off", default=None, help="server without prefix caching")
    p.add_argument("--base-url-off", default=None, help="without commands: the cache-off server's URL")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--num-prefixes", type=int, default=1)
    p.add_argument("--output-tokens", type=int, default=None)
    p.add_argument("--out-dir", default="loadtest-results/bench_prefix_cache")
    a = p.parse_args(argv)

    counter = counter_for(a.tokenizer)
    wl = workloads.WorkloadConfig(
        "shared-prefix",
        num_requests=a.num_requests,
        seed=a.seed,
        prefix_tokens=a.prefix_tokens,
        num_prefixes=a.num_prefixes,
        output_tokens=a.output_tokens,
    )
    specs = workloads.build(wl, counter)
    os.makedirs(a.out_dir, exist_ok=True)
    results = {}
    for name, cmd, url in (
        ("on", a.server_cmd_on, a.base_url),
        ("off", a.server_cmd_off, a.base_url_off or a.base_url),
    ):
        cfg = client_for(a, url)
        config = {
            "client": {"base_url": url, "model": a.model, "ignore_eos": cfg.ignore_eos},
            "workload": {
                "name": wl.name,
                "seed": a.seed,
                "tokenizer": counter.name,
                "prefix_tokens": a.prefix_tokens,
                "num_requests": a.num_requests,
            },
            "bench": "prefix_cache",
            "prefix_caching": name,
            "server_cmd": cmd,
        }
        with ServerProcess(cmd, cfg.root, a.server_timeout, os.path.join(a.out_dir, f"server_{name}.log")):
            res = measure(
                specs,
                cfg,
                ClosedLoop(a.concurrency),
                SLO(),
                config,
                label=f"prefix cache {name}",
                max_duration=a.duration,
                progress=not a.no_progress,
                desc=f"cache {name}",
            )
        save(res, os.path.join(a.out_dir, f"{name}.json"))
        results[name] = res
    table = summary_table(results["on"], results["off"])
    with open(os.path.join(a.out_dir, "table.md"), "w") as f:
        f.write(table + "\n\n" + render([results["on"], results["off"]], markdown=True) + "\n")
    print(table + "\n")
    print(render([results["on"], results["off"]]))
    plots.plot_results([results["on"], results["off"]], a.out_dir, prefix="compare_")
    print(f"\nwritten to {a.out_dir}/: on.json, off.json, table.md, compare_latency_cdf.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
