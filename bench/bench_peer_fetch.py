"""Hot tenants past the load guard: TTFT with fetches from a peer (`kv_peer_fetch: auto`) against
recomputing (`off`), side by side in one run, over the same 3 engine replicas' app shape.

Per mode, a fresh Serve app (3 replicas of the embedded model, cache-aware routing, cold
caches) runs the same seeded workload: tenants in turn, each with a system prompt of ~1,000
tokens, send one request (its replica caches the prefix), then a burst of `--burst` requests
(system prompt + a short question) at `--concurrency` at once. The burst piles onto the replica
holding the prefix until the load guard (4 in-flight requests) sends requests to the others,
which then fetch the prefix from it (auto) or recompute it (off). Prompts go as token ids
through /v1/completions (streamed, greedy). TTFT counts the bursts' requests.

Reports per mode: TTFT p50/p99/mean, the prompt tokens the replicas computed (not found in any
cache), fetches from peers and the tokens and bytes they moved, fetch failures, and the seconds
per fetch.

    python -m bench.bench_peer_fetch [--tenants 4 --burst 12 --concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

from bench.bench_routing import Run, pct, text

MODES = ("auto", "off")


async def hot_tenants(run: Run, tok, args, rng: random.Random) -> None:
    systems = [tok.encode(f"Tenant {k}. " + text(rng, args.system_words)) for k in range(args.tenants)]
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600) as c:

        async def go(ids: list[int]) -> None:
            async with sem:
                await run.one(c, ids)

        for k in range(args.tenants):  # one tenant hot at a time
            warm = Run(run.url, run.max_tokens)  # not counted: its replica computes the prefix
            await warm.one(c, systems[k] + tok.encode("\nUser: hello?\nAnswer:"))
            burst = [systems[k] + tok.encode(f"\nUser: {text(rng, 8)}?\nAnswer:") for _ in range(args.burst)]
            await asyncio.gather(*(go(ids) for ids in burst))


def measure(mode: str, args, tok) -> dict:
    from ray import serve

    from router.app import build_app
    from router.config import AppConfig

    cfg = AppConfig(
        dtype="float32",
        num_replicas=3,
        routing="cache-aware",
        kv_peer_fetch=mode,
        kv_cache_memory_bytes=args.kv_mib << 20,
        num_threads=1,
        cpus_per_worker=1.0,
    )
    handle = serve.run(build_app(cfg), name="bench", route_prefix="/")
    try:
        run = Run(f"http://127.0.0.1:{args.port}", args.max_tokens)
        t0 = time.perf_counter()
        asyncio.run(hot_tenants(run, tok, args, random.Random(args.seed)))
        wall = time.perf_counter() - t0
        stats = handle.replica_stats.remote().result()
    finally:
        serve.delete("bench")

    def total(key: str) -> float:
        return sum(s.get(key) or 0 for s in stats)

    fetch_hist = [s["histograms"]["kv_peer_fetch_seconds"] for s in stats]
    fetch_s = sum(h["sum"] for h in fetch_hist) / max(1, sum(sum(h["counts"]) for h in fetch_hist))
    return {
        "mode": mode,
        "requests": len(run.ttft),
        "ttft_p50_s": statistics.median(run.ttft),
        "ttft_p99_s": pct(run.ttft, 0.99),
        "ttft_mean_s": statistics.fmean(run.ttft),
        # a fetch's tokens are no hit in the engine's own count: neither are they computed
        "prompt_tokens_computed": total("prefix_cache_queries")
        - total("prefix_cache_hits")
        - total("kv_peer_tokens_fetched"),
        "peer_fetches": total("kv_peer_fetches"),
        "peer_tokens_fetched": total("kv_peer_tokens_fetched"),
        "peer_fetch_mb": total("kv_peer_fetch_bytes") / 1e6,
        "peer_fetch_failures": total("kv_peer_fetch_failures"),
        "seconds_per_fetch": fetch_s,
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--system-words", type=int, default=700, help="~1,000 tokens")
    p.add_argument("--burst", type=int, default=12, help="requests per tenant, sent together")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kv-mib", type=int, default=512, help="KV cache per replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows here too")
    args = p.parse_args(argv)

    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from engine.model_config import build_model_config
    from tests.net import free_port

    mc = build_model_config(None, "float32", __import__("torch").device("cpu"), None, None)
    tok = AutoTokenizer.from_pretrained(mc.model_dir)
    args.port = free_port()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        for mode in MODES:
            rows.append(measure(mode, args, tok))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(
        "\n| kv_peer_fetch | requests | TTFT p50 s | TTFT p99 s | TTFT mean s | prompt tokens computed "
        "| fetches | tokens fetched | MB fetched | failures | s/fetch |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['requests']} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['ttft_mean_s']:.2f} "
            f"| {r['prompt_tokens_computed']:.0f} | {r['peer_fetches']:.0f} | {r['peer_tokens_fetched']:.0f} "
            f"| {r['peer_fetch_mb']:.1f} | {r['peer_fetch_failures']:.0f} | {r['seconds_per_fetch']:.3f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
