"""Overload: requests arriving at 5x what the server completes must be refused at once (429 with a
Retry-After that follows the queue), and the requests it accepts must keep their time to first
token: the p99 TTFT of the accepted ones against the p99 at capacity.

    python -m loadtest.bench_overload --server-cmd "orbital serve --max-num-seqs 8 \
        --max-queued-requests 8" --base-url http://127.0.0.1:8000

Phase 1 (capacity): closed loop at `--capacity` concurrent requests, every one accepted; its
completion rate is the server's capacity in requests/s. Phase 2 (overload): Poisson arrivals at
`--factor` x that rate for the same number of requests. Prints one table and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter

from loadtest import workloads
from loadtest.arrivals import ClosedLoop, Poisson
from loadtest.bench_concurrency import bench_args, client_for, counter_for
from loadtest.metrics import stats_ms
from loadtest.runner import run
from loadtest.server import ServerProcess


def phase(records, duration_s: float) -> dict:
    ok = [r for r in records if r.success]
    refused = [r for r in records if r.http_status == 429]
    waits = sorted(float(r.retry_after) for r in refused if r.retry_after)
    return {
        "sent": len(records),
        "accepted_ok": len(ok),
        "refused_429": len(refused),
        "other_errors": dict(Counter(r.error_kind for r in records if not r.success and r.http_status != 429)),
        "completed_per_s": len(ok) / max(duration_s, 1e-9),
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "refusal_ms": stats_ms([r.latency or 0.0 for r in refused if r.latency is not None]),
        "retry_after_s": {"min": waits[0], "median": waits[len(waits) // 2], "max": waits[-1]} if waits else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_args(p)
    p.add_argument("--server-cmd", default=None, help="start this server first (stopped at the end)")
    p.add_argument("--capacity", type=int, default=8, help="concurrent requests the server runs (max_num_seqs)")
    p.add_argument("--factor", type=float, default=5.0, help="overload: this x the measured request rate")
    p.add_argument("--num-requests", type=int, default=64, help="requests per phase")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--out", default="loadtest-results/bench_overload.json")
    a = p.parse_args(argv)

    counter = counter_for(a.tokenizer)
    cfg = client_for(a)
    specs = workloads.build(
        workloads.WorkloadConfig("mixed", num_requests=a.num_requests, seed=a.seed, output_tokens=a.output_tokens),
        counter,
    )
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with ServerProcess(a.server_cmd, cfg.root, a.server_timeout, a.out + ".server.log"):
        run(specs[: a.capacity], cfg, ClosedLoop(a.capacity), progress=False)  # warm-up
        cap = run(specs, cfg, ClosedLoop(a.capacity), progress=not a.no_progress, desc="at capacity")
        base = phase(cap.records, cap.duration_s)
        rate = a.factor * base["completed_per_s"]
        over = run(specs, cfg, Poisson(rate, a.seed), progress=not a.no_progress, desc=f"at {a.factor:g}x")
        loaded = phase(over.records, over.duration_s)
    ratio = loaded["ttft_ms"]["p99"] / base["ttft_ms"]["p99"] if loaded["ttft_ms"]["count"] else None
    out = {"capacity": base, "overload": loaded, "arrival_rate_per_s": rate, "ttft_p99_ratio": ratio}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    rows = [("at capacity (closed loop)", base), (f"{a.factor:g}x arrivals ({rate:.2f}/s)", loaded)]
    print("| phase | sent | ok | 429 | other errors | TTFT p50 ms | TTFT p99 ms | Retry-After s (min/med/max) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, ph in rows:
        ra = ph["retry_after_s"]
        ra_s = f"{ra['min']:g}/{ra['median']:g}/{ra['max']:g}" if ra else "-"
        t = ph["ttft_ms"]
        print(
            f"| {name} | {ph['sent']} | {ph['accepted_ok']} | {ph['refused_429']} | {ph['other_errors'] or '-'} "
            f"| {t['p50']:.0f} | {t['p99']:.0f} | {ra_s} |"
        )
    print(f"\naccepted requests' TTFT p99 under overload / at capacity: {ratio:.2f}x (aim <= 2x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
