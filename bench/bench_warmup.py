"""The first requests after a server starts against the ones after them: TTFT of the first 10 of
60 streamed requests at one stream (uniform prompts of 20-600 tokens, outputs fixed) against the
next 50, for a fresh server with and without its warm-up (`--no-warmup`), side by side in one run.
The first 10 prompts are sent once more at the end with a few words in front (the same shapes,
no cached prefix): their TTFT against the first send is the cold start without the prompts'
own lengths in it.

    python -m bench.bench_warmup --rounds 2 [--dtype auto] [--threads 2]

Each round starts one fresh server per configuration (alternating which goes first), waits until
it answers, then sends the requests one after another. Prints per round and the medians over
rounds: TTFT median and p95 of the first 10 and of the next 50, the first 10's p95 over the next
50's, and the median over the first 10 of each one's TTFT over its replay's.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

from bench.bench_llamacpp import free_port
from loadtest import workloads
from loadtest.arrivals import Burst
from loadtest.client import ClientConfig
from loadtest.runner import run
from loadtest.server import ServerProcess
from loadtest.tokens import load_counter

FIRST = 10  # the requests a fresh replica's first users send


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


def one_server(warmup: str, specs, a) -> dict:
    port = free_port()
    cmd = (
        f"{sys.executable} -m router.cli serve --host 127.0.0.1 --port {port} --threads {a.threads} "
        f"--dtype {a.dtype}" + (" --no-warmup" if warmup == "off" else "")
    )
    root = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with ServerProcess(cmd, root, log_path=f"/tmp/bench_warmup_{warmup}.log"):
        ready_s = time.perf_counter() - t0
        cfg = ClientConfig(base_url=root, ignore_eos=True, temperature=0.0, timeout=600.0)
        out = run(specs, cfg, Burst(len(specs), 0.0), max_concurrency=1, progress=False)
    recs = sorted(out.records, key=lambda r: r.start)
    if any(r.ttft is None for r in recs):
        raise RuntimeError(f"requests failed: {[r.error for r in recs if r.ttft is None]}")
    ttft = [1000 * r.ttft for r in recs]
    first, rest, replay = ttft[:FIRST], ttft[FIRST:-FIRST], ttft[-FIRST:]
    return {
        "ready_s": ready_s,
        "first_p50": statistics.median(first),
        "first_p95": p95(first),
        "rest_p50": statistics.median(rest),
        "rest_p95": p95(rest),
        "first_over_replay": statistics.median(f / r for f, r in zip(first, replay)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--configs", default="off,on", help="warm-up off (--no-warmup) and on (the default)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    cfg = workloads.WorkloadConfig("uniform", num_requests=a.requests, seed=a.seed, output_tokens=a.output_tokens)
    specs = workloads.build(cfg, load_counter("smollm2"))
    specs += [dataclasses.replace(s, id=f"{s.id}-again", prompt="Once more: " + s.prompt) for s in specs[:FIRST]]
    configs = a.configs.split(",")
    results: dict[str, list[dict]] = {c: [] for c in configs}
    for r in range(a.rounds):
        for c in configs if r % 2 == 0 else configs[::-1]:
            m = one_server(c, specs, a)
            results[c].append(m)
            print(f"round {r} warmup={c}: " + ", ".join(f"{k} {v:.2f}" for k, v in m.items()), flush=True)
    print(
        f"\n| warm-up | ready s | first {FIRST} TTFT p50 / p95 ms | next TTFT p50 / p95 ms | p95 first / next "
        "| first / replayed (median) |"
    )
    print("|---|---|---|---|---|---|")
    for c, ms in results.items():
        med = {k: statistics.median(m[k] for m in ms) for k in ms[0]}
        print(
            f"| {c} | {med['ready_s']:.1f} | {med['first_p50']:.0f} / {med['first_p95']:.0f} | "
            f"{med['rest_p50']:.0f} / {med['rest_p95']:.0f} | {med['first_p95'] / med['rest_p95']:.2f}x | "
            f"{med['first_over_replay']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
