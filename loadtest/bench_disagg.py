"""Benchmark: colocated (2 engine replicas) vs disaggregated (1 prefill + 1 decode replica) on
the same cores, a mix of long-prompt and chat requests at a fixed Poisson arrival rate.

    python -m loadtest.bench_disagg --rounds 2 --rate 0.4

Each round starts `orbital serve` once per configuration (interleaved: colocated, P/D,
colocated, ...), sends the same seeded workload, and reads the transfer counters from /metrics.
Prints per configuration (medians over rounds): TTFT p50/p99, inter-token latency p50/p99 of
the chat streams (the ones a long prefill disturbs when it shares their replica), output
tokens/s, goodput under the SLO, and for P/D the blocks, bytes and seconds per transfer and
the transfer's share of the remote requests' TTFT; then the ratios P/D / colocated.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import httpx

from loadtest import textgen, workloads
from loadtest.arrivals import Poisson
from loadtest.bench_concurrency import counter_for
from loadtest.client import ClientConfig
from loadtest.metrics import SLO, aggregate, stats_ms
from loadtest.runner import run
from loadtest.server import ServerProcess
from loadtest.tokens import TokenCounter

CONFIGS = {
    "colocated": "--replicas 2",
    "disaggregated": "--prefill-replicas 1 --decode-replicas 1",
}
TRANSFER = ("kv_transfers", "kv_transfer_blocks", "kv_transfer_bytes", "kv_transfer_failures")


def build_workload(n: int, long_share: float, long_tokens: int, seed: int, counter: TokenCounter):
    """Chat requests (the mixed workload's) with long-prompt ones interleaved."""
    rng = random.Random(seed)
    chat = workloads.mixed(n, rng, counter)
    specs = []
    for i, spec in enumerate(chat):
        if rng.random() < long_share:
            prompt = textgen.fit(rng, counter, f"Document {i}:", "Question: what is the main point?", long_tokens)
            spec = workloads.RequestSpec(
                f"long-{i}", 32, prompt=prompt, prompt_tokens=counter.count(prompt), kind="long"
            )
        else:
            spec.max_tokens = min(spec.max_tokens, 96)
            spec.kind = "chat"
        specs.append(spec)
    return specs


def wait_healthy(root: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{root}/health", timeout=30).status_code != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{root}/health not ok after {timeout:.0f} s")
        time.sleep(1.0)


def transfer_counters(root: str) -> dict[str, float]:
    """The decode side's transfer counters and transfer-time sum from /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{root}/metrics", timeout=30).text
    values: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    out = {k: values.get(f"orbital:{k}_total", 0.0) for k in TRANSFER}
    out["kv_transfer_seconds_sum"] = values.get("orbital:kv_transfer_seconds_sum", 0.0)
    return out


def wait_gone(root: str, timeout: float = 120.0) -> None:
    """Until the stopped server's port refuses connections and its Serve replicas have exited
    (a new server must not share the cores with the old one's leftovers)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{root}/health", timeout=2)
        except httpx.HTTPError:
            left = subprocess.run(["pgrep", "-f", "ServeReplica:orbital"], capture_output=True, text=True).stdout
            if not left.strip():
                return
        time.sleep(1.0)


def measure(name: str, a, specs, slo: SLO, port: int) -> dict:
    cmd = f"{sys.executable} -m router.cli serve --port {port} --dtype {a.dtype} {CONFIGS[name]} {a.serve_args}"
    root = f"http://127.0.0.1:{port}"
    with ServerProcess(cmd, root, log_path=os.path.join(a.out_dir, f"{name}.log")):
        wait_healthy(root)  # /v1/models answers before the engine replicas are up
        before = transfer_counters(root)
        out = run(specs, ClientConfig(base_url=root), Poisson(a.rate, seed=a.seed), progress=False)
        after = transfer_counters(root)
    wait_gone(root)
    recs = out.records
    agg = aggregate(recs, out.duration_s, slo)
    chat = [r for r in recs if r.success and r.kind == "chat"]
    longs = [r for r in recs if r.success and r.kind == "long"]
    moved = {k: after[k] - before[k] for k in after}
    n = moved["kv_transfers"] or 0
    ttft_long = statistics.mean(r.ttft for r in longs) if longs else None
    return {
        "ttft_p50": agg["ttft_ms"]["p50"],
        "ttft_p99": agg["ttft_ms"]["p99"],
        "chat_itl_p50": stats_ms([g for r in chat for g in r.itl])["p50"],
        "chat_itl_p99": stats_ms([g for r in chat for g in r.itl])["p99"],
        "chat_itl_max": stats_ms([g for r in chat for g in r.itl])["max"],
        "chat_stalls_over_1s": sum(g > 1.0 for r in chat for g in r.itl),
        "long_ttft_p50": stats_ms([r.ttft for r in longs])["p50"],
        "output_tok_s": agg["output_tok_s"],
        "goodput_req_s": agg["goodput"]["req_s"],
        "failed": agg["failed"],
        "transfers": n,
        "blocks_per_transfer": moved["kv_transfer_blocks"] / n if n else None,
        "mb_per_transfer": moved["kv_transfer_bytes"] / n / 1e6 if n else None,
        "ms_per_transfer": 1e3 * moved["kv_transfer_seconds_sum"] / n if n else None,
        "transfer_share_of_long_ttft": (moved["kv_transfer_seconds_sum"] / n) / ttft_long if n and ttft_long else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--rate", type=float, default=0.4, help="requests/s (Poisson)")
    p.add_argument("--long-share", type=float, default=0.25)
    p.add_argument("--long-tokens", type=int, default=1200)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=4000)
    p.add_argument("--slo-tpot-ms", type=float, default=150)
    p.add_argument("--serve-args", default="--threads 1", help="extra `orbital serve` flags for both")
    p.add_argument("--out-dir", default="loadtest-results/bench_disagg")
    a = p.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    counter = counter_for("smollm2")
    specs = build_workload(a.requests, a.long_share, a.long_tokens, a.seed, counter)
    slo = SLO(ttft_ms=a.slo_ttft_ms, tpot_ms=a.slo_tpot_ms)
    runs: dict[str, list[dict]] = {k: [] for k in CONFIGS}
    port = a.port
    for r in range(a.rounds):
        for name in CONFIGS:
            runs[name].append(measure(name, a, specs, slo, port))
            port += 1
            print(f"round {r + 1} {name}: {json.dumps(runs[name][-1])}", flush=True)
    med = {
        name: {k: statistics.median([x[k] for x in rs if x[k] is not None] or [float("nan")]) for k in rs[0]}
        for name, rs in runs.items()
    }
    keys = list(med["colocated"])
    print("\n| metric | colocated (2 replicas) | P/D (1 prefill + 1 decode) | P/D / colocated |")
    print("|---|---|---|---|")
    for k in keys:
        c, d = med["colocated"][k], med["disaggregated"][k]
        ratio = d / c if c and c == c and d == d else float("nan")
        print(f"| {k} | {c:.3g} | {d:.3g} | {ratio:.2f}x |")
    with open(os.path.join(a.out_dir, "result.json"), "w") as f:
        json.dump({"args": vars(a), "runs": runs, "medians": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
