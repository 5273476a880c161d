"""Adapter-aware replica choice against least-loaded, side by side in one run: how often a request
lands on a replica that already holds its LoRA adapter, and what the misses cost.

Per policy, a fresh Serve app of 3 replicas of the embedded model (float32, 1 thread each), LoRA
on with `--adapters` random rank-16 adapters registered (`lora_modules`), each replica holding at
most `--max-cpu-loras` of them (an LRU: a miss reads the adapter from disk, and may evict one).
The same seeded workload per policy: `--requests` completions whose adapters are drawn with
Zipf-like weights (a few hot, a long tail), prompts of random words sharing no prefix, streamed,
greedy, `--max-tokens` each, `--concurrency` at once. Reports the adapter hit rate (requests
whose replica held the adapter: 1 - adapter loads / requests), adapter loads and evictions, and
TTFT p50/p99.

    python -m bench.bench_lora_routing [--requests 60 --adapters 8 --max-cpu-loras 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_routing import pct, text

POLICIES = ("cache-aware", "least-loaded")


async def workload(url: str, names: list[str], args, rng: random.Random) -> list[float]:
    weights = [1 / (k + 1) for k in range(len(names))]
    reqs = [(rng.choices(names, weights)[0], text(rng, 30)) for _ in range(args.requests)]
    sem = asyncio.Semaphore(args.concurrency)
    ttft: list[float] = []
    async with httpx.AsyncClient(timeout=600) as c:

        async def one(model: str, prompt: str) -> None:
            async with sem:
                t0 = time.perf_counter()
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "stream": True,
                }
                first = None
                async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if first is None and line.startswith("data: ") and line != "data: [DONE]":
                            first = time.perf_counter() - t0
                ttft.append(first if first is not None else time.perf_counter() - t0)

        await asyncio.gather(*(one(m, p) for m, p in reqs))
    return ttft


def measure(policy: str, args, adapters: dict[str, str]) -> dict:
    from ray import serve

    from router.app import build_app
    from router.config import AppConfig

    cfg = AppConfig(
        dtype="float32",
        num_replicas=3,
        routing=policy,
        enable_lora=True,
        max_loras=min(args.max_cpu_loras, 4),
        max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=16,
        lora_modules=adapters,
        kv_cache_memory_bytes=64 << 20,
        num_threads=1,
        cpus_per_worker=1.0,
    )
    handle = serve.run(build_app(cfg), name="bench", route_prefix="/")
    try:
        before = handle.replica_stats.remote().result()
        t0 = time.perf_counter()
        ttft = asyncio.run(workload(f"http://127.0.0.1:{args.port}", list(adapters), args, random.Random(args.seed)))
        wall = time.perf_counter() - t0
        after = handle.replica_stats.remote().result()
    finally:
        serve.delete("bench")

    def total(stats: list[dict], key: str) -> float:
        return sum(s.get(key) or 0 for s in stats)

    loads = total(after, "num_lora_loads") - total(before, "num_lora_loads")
    return {
        "policy": policy,
        "requests": len(ttft),
        "adapter_hit_rate": 1 - loads / len(ttft),
        "adapter_loads": loads,
        "adapter_evictions": total(after, "num_lora_evictions") - total(before, "num_lora_evictions"),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": pct(ttft, 0.99),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--max-cpu-loras", type=int, default=2, help="adapters each replica holds")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import ray
    import torch
    from ray import serve

    from bench.bench_lora import write_adapter
    from engine.model_config import build_model_config
    from tests.net import free_port

    hf_config = build_model_config(None, "float32", torch.device("cpu"), None, None).hf_config
    args.port = free_port()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {}
        for i in range(args.adapters):
            write_adapter(Path(tmp) / f"a{i}", hf_config, 16, seed=i)
            adapters[f"a{i}"] = str(Path(tmp) / f"a{i}")
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": args.port})
            for policy in POLICIES:
                rows.append(measure(policy, args, adapters))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            serve.shutdown()
            ray.shutdown()
    print("\n| routing | requests | adapter hit rate | adapter loads | evictions | TTFT p50 s | TTFT p99 s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['policy']} | {r['requests']} | {r['adapter_hit_rate']:.1%} | {r['adapter_loads']:.0f} "
            f"| {r['adapter_evictions']:.0f} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
