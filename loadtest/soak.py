"""Soak: hours-long traffic with engine replicas killed from outside, the way an operator leaves
a server running. Closed loop at `--concurrency` on the mixed workload for `--minutes`; every
`--kill-every-s` one engine replica process (found by its Ray process title, so the server must
run on this machine) gets SIGKILL while another stays up. At the end: requests sent, completed,
moved to another replica and failed (the aim is 0), TTFT and end-to-end p50/p99 per minute (a
plot), and whether every KV block went back to its pool (the server's /metrics once idle).
With `--poison-every-s`, a hostile request (ids past the vocabulary, huge top_k, stop strings
past their cap, a multi-prompt body with a prompt too long) goes out that often beside the
traffic: the report counts their answers and the engine replicas that died without being killed.

    python -m loadtest.soak --server-cmd "orbital serve --replicas 2 --port 8012" \
        --base-url http://127.0.0.1:8012 --minutes 30 --concurrency 64 --kill-every-s 240
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import time
from collections import Counter

import httpx
import numpy as np

from loadtest import workloads
from loadtest.arrivals import ClosedLoop
from loadtest.bench_concurrency import bench_args, client_for, counter_for
from loadtest.runner import run_async
from loadtest.server import ServerProcess

ENGINE_TITLE = r"ServeReplica:[^ ]*:EngineReplica"
_SAMPLE = re.compile(r"^(orbital:[a-z_]+)(\{[^}]*\})?\s+([-+0-9.eE]+)")


def engine_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", ENGINE_TITLE], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def scrape(root: str) -> dict[str, float]:
    """orbital:* samples summed over labels (pools, replicas, reasons)."""
    text = httpx.get(root + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


async def killer(every_s: float, until: float, rng: random.Random, log: list) -> None:
    while time.monotonic() + every_s < until:
        await asyncio.sleep(every_s)
        pids = engine_pids()
        if len(pids) < 2:  # keep one serving: the point is moving requests, not an outage
            log.append({"t": time.time(), "skipped": f"{len(pids)} engine replica(s) up"})
            continue
        pid = rng.choice(pids)
        os.kill(pid, signal.SIGKILL)
        log.append({"t": time.time(), "killed_pid": pid})


# Requests that once took an engine replica down or answered 500 (docs/reliability.md).
POISON = [
    {"prompt": "hi", "max_tokens": 4, "top_k": 2**63, "temperature": 1},
    {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [2**64], "min_tokens": 1},
    {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [10**9], "min_tokens": 1},
    {"prompt": "hi", "max_tokens": 4, "stop": ["x" * 200_000] * 16},
    {"prompt": ["hi", "word " * 50_000], "max_tokens": 4},
    {"prompt": "hi", "max_tokens": 4, "seed": 2**64 + 1, "temperature": 1, "top_k": 2**40},
]


async def poisoner(root: str, every_s: float, until: float, log: list) -> None:
    """One poison request every `every_s`; each answer's status goes to `log`."""
    async with httpx.AsyncClient(timeout=120) as client:
        i = 0
        while time.monotonic() + every_s < until:
            await asyncio.sleep(every_s)
            body = POISON[i % len(POISON)]
            i += 1
            try:
                r = await client.post(root + "/v1/completions", json=body)
                log.append({"t": time.time(), "status": r.status_code})
            except httpx.HTTPError as e:
                log.append({"t": time.time(), "status": type(e).__name__})


async def pid_watch(until: float, log: list, kills: list) -> None:
    """Engine replica pids that vanished without the killer's SIGKILL: replica deaths the soak
    did not cause."""
    seen = set(engine_pids())
    while time.monotonic() < until:
        await asyncio.sleep(1.0)
        now = set(engine_pids())
        killed = {k["killed_pid"] for k in kills if "killed_pid" in k}
        for pid in seen - now - killed:
            log.append({"t": time.time(), "died_pid": pid})
        seen = now


def per_minute(records, start_wall: float) -> list[dict]:
    rows: dict[int, dict[str, list]] = {}
    for r in records:
        if not r.success:
            continue
        minute = int(r.start // 60)
        row = rows.setdefault(minute, {"ttft": [], "e2e": []})
        row["ttft"].append(r.ttft)
        row["e2e"].append(r.latency)
    out = []
    for m in sorted(rows):
        t, e = np.asarray(rows[m]["ttft"]) * 1e3, np.asarray(rows[m]["e2e"]) * 1e3
        out.append(
            {
                "minute": m,
                "completed": len(t),
                "ttft_p50_ms": float(np.percentile(t, 50)),
                "ttft_p99_ms": float(np.percentile(t, 99)),
                "e2e_p50_ms": float(np.percentile(e, 50)),
                "e2e_p99_ms": float(np.percentile(e, 99)),
            }
        )
    return out


def plot(rows: list[dict], kills: list[dict], start_wall: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    x = [r["minute"] + 0.5 for r in rows]
    for key, style in (("ttft_p50_ms", "-"), ("ttft_p99_ms", "--"), ("e2e_p50_ms", "-"), ("e2e_p99_ms", "--")):
        ax.plot(x, [r[key] / 1e3 for r in rows], style, label=key.replace("_ms", "").replace("_", " "))
    for k in kills:
        if "killed_pid" in k:
            ax.axvline((k["t"] - start_wall) / 60, color="red", alpha=0.4)
    ax.set_xlabel("minute (red: a replica killed)")
    ax.set_ylabel("seconds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def wait_idle(root: str, timeout_s: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(root)
        idle = m.get("orbital:num_requests_running", 1) == 0 and m.get("orbital:kv_cache_usage_perc", 1) == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_args(p)
    p.add_argument("--server-cmd", default=None, help="start this server first (stopped at the end)")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--kill-every-s", type=float, default=240.0)
    p.add_argument("--output-tokens", type=int, default=None, help="cap every output length")
    p.add_argument("--poison-every-s", type=float, default=0.0, help="send a poison request this often (0: none)")
    p.add_argument("--out-dir", default="loadtest-results/soak")
    a = p.parse_args(argv)

    cfg = client_for(a)
    duration = a.minutes * 60
    # Enough requests for the whole run even if they were all short.
    n = int(max(1000, a.concurrency * a.minutes * 30))
    specs = workloads.build(
        workloads.WorkloadConfig("mixed", num_requests=n, seed=a.seed, output_tokens=a.output_tokens),
        counter_for(a.tokenizer),
    )
    os.makedirs(a.out_dir, exist_ok=True)
    kills: list[dict] = []
    poison: list[dict] = []
    deaths: list[dict] = []
    with ServerProcess(a.server_cmd, cfg.root, a.server_timeout, os.path.join(a.out_dir, "server.log")):
        before = scrape(cfg.root)
        start_wall = time.time()

        async def soak():
            until = time.monotonic() + duration
            tasks = [
                asyncio.create_task(killer(a.kill_every_s, until, random.Random(a.seed), kills)),
                asyncio.create_task(pid_watch(until, deaths, kills)),
            ]
            if a.poison_every_s > 0:
                tasks.append(asyncio.create_task(poisoner(cfg.root, a.poison_every_s, until, poison)))
            try:
                return await run_async(
                    specs, cfg, ClosedLoop(a.concurrency), max_duration=duration, progress=not a.no_progress
                )
            finally:
                for task in tasks:
                    task.cancel()

        out = asyncio.run(soak())
        after = wait_idle(cfg.root)
    recs = out.records
    failed = Counter(r.error_kind for r in recs if not r.success)
    summary = {
        "minutes": a.minutes,
        "concurrency": a.concurrency,
        "sent": len(recs),
        "completed": sum(r.success for r in recs),
        "failed": sum(failed.values()),
        "failed_by_kind": dict(failed),
        "replicas_killed": sum("killed_pid" in k for k in kills),
        "migrated": after.get("orbital:router_migrations_total", 0) - before.get("orbital:router_migrations_total", 0),
        "migration_failures": after.get("orbital:router_migration_failures_total", 0)
        - before.get("orbital:router_migration_failures_total", 0),
        "idle_at_end": {
            "requests_running": after.get("orbital:num_requests_running"),
            "kv_cache_usage_perc": after.get("orbital:kv_cache_usage_perc"),
        },
        "per_minute": per_minute(recs, start_wall),
        "kills": kills,
        "poison_sent": len(poison),
        "poison_answers": dict(Counter(str(p["status"]) for p in poison)),
        "replica_deaths_not_killed": len(deaths),
    }
    with open(os.path.join(a.out_dir, "soak.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(summary["per_minute"], kills, start_wall, os.path.join(a.out_dir, "latency_over_time.png"))
    keys = ("sent", "completed", "failed", "replicas_killed", "migrated", "migration_failures")
    print("| " + " | ".join(keys) + " | KV usage at end |")
    print("|" + "---|" * (len(keys) + 1))
    print("| " + " | ".join(f"{summary[k]:g}" for k in keys) + f" | {after.get('orbital:kv_cache_usage_perc')} |")
    if poison:
        print(f"poison requests: {len(poison)} sent, answers {summary['poison_answers']}")
    print(f"engine replica deaths the soak did not cause: {len(deaths)}")
    if failed:
        print("failures:", dict(failed))
    print(f"\nwritten to {a.out_dir}/: soak.json, latency_over_time.png")
    bad_poison = any(str(p["status"]).startswith("5") or not str(p["status"]).isdigit() for p in poison)
    return 0 if not failed and not deaths and not bad_poison else 1


if __name__ == "__main__":
    raise SystemExit(main())
