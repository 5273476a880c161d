"""Cache-aware vs least-loaded vs round-robin routing over the same 3 engine replicas, and
cache-aware routing with the cluster-wide KV cache (an offload tier per replica and fetching a
prefix from the replica that holds it) against cache-aware routing without it.

For each policy, in one run: a fresh Serve app (3 replicas of the embedded model, cold caches)
runs (a) a multi-tenant workload — 8 system prompts of ~1,000 tokens, each followed by short
user turns — (b) multi-turn chats of 4-8 turns (each turn's prompt is the conversation so
far) and (c) a hot tenant: one ~1,000-token system prompt sent with many requests at once, past
what the load guard lets one replica take. Prompts go as token ids through /v1/completions
(streamed, greedy), so the ideal hit rate can be computed from the very ids: every shared full
block prefilled once per replica it must live on (once, for a prefix that fits one replica).

Policies: `cache-aware`, `least-loaded`, `round-robin` (no offload tier, no fetch from peers),
and `cache-aware+tiers` (a disk tier of `--offload-mib` per replica, fetch from peers `auto`).
With `--kv-mib` small enough that the workloads evict (64: ~1,400 tokens per replica in float32),
the tier keeps what the pool evicts:

    python -m bench.bench_routing --policies cache-aware,cache-aware+tiers --kv-mib 64 --chats 30

Reports per policy and workload: prefix-cache hit rate (engine-reported, all replicas) against
the ideal, TTFT p50/p99, output tokens/s, and the routing decision's CPU time per request.

    python -m bench.bench_routing [--tenants 8 --turns 6 --chats 6 --concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

WORDS = (
    "alpha beta gamma delta river stone cloud ember maple orbit quartz violet harbor lantern meadow "
    "copper signal basin thunder willow canyon prism falcon glacier nectar"
).split()


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def common_blocks(a: list[int], b: list[int], bs: int) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n // bs


class Run:
    def __init__(self, url: str, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.ttft: list[float] = []
        self.out_tokens = 0

    async def one(self, c: httpx.AsyncClient, ids: list[int]) -> str:
        t0 = time.perf_counter()
        body = {"prompt": ids, "max_tokens": self.max_tokens, "temperature": 0, "stream": True, "logprobs": 0}
        out = []
        first = None
        async with c.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ch = json.loads(line[6:])["choices"][0]
                if ch.get("text") and first is None:
                    first = time.perf_counter() - t0
                out.append(ch.get("text") or "")
                self.out_tokens += len((ch.get("logprobs") or {}).get("tokens") or [])
        self.ttft.append(first if first is not None else time.perf_counter() - t0)
        return "".join(out)


async def multi_tenant(run: Run, tok, args, rng: random.Random) -> tuple[int, int]:
    """Returns (ideal hit tokens, prompt tokens)."""
    systems = [tok.encode(f"Tenant {k}. " + text(rng, args.system_words)) for k in range(args.tenants)]
    reqs = [
        (k, systems[k] + tok.encode(f"\nUser: {text(rng, 8)}?\nAnswer:"))
        for _ in range(args.turns)
        for k in range(args.tenants)
    ]
    seen: dict[int, list[int]] = {}
    ideal = total = 0
    for k, ids in reqs:
        total += len(ids)
        if k in seen:
            ideal += (
                min(common_blocks(seen[k], ids, args.block_size), (len(ids) - 1) // args.block_size) * args.block_size
            )
        else:
            seen[k] = ids
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600) as c:

        async def go(ids):
            async with sem:
                await run.one(c, ids)

        await asyncio.gather(*(go(ids) for _, ids in reqs))
    return ideal, total


async def hot_tenant(run: Run, tok, args, rng: random.Random) -> tuple[int, int]:
    """One system prompt, `--hot-requests` requests at once: the holder of its prefix fills past
    the load guard and the rest go to replicas without it."""
    system = tok.encode("Hot tenant. " + text(rng, args.system_words))
    reqs = [system + tok.encode(f"\nUser: {text(rng, 8)}?\nAnswer:") for _ in range(args.hot_requests)]
    # Ideal: the prefix computed once on one replica, then hit by every other request.
    shared = min(common_blocks(reqs[0], reqs[1], args.block_size) * args.block_size, len(system))
    ideal, total = shared * (len(reqs) - 1), sum(len(ids) for ids in reqs)
    async with httpx.AsyncClient(timeout=600) as c:
        await run.one(c, reqs[0])  # the holder
        await asyncio.gather(*(run.one(c, ids) for ids in reqs[1:]))
    return ideal, total


async def multi_turn(run: Run, tok, args, rng: random.Random) -> tuple[int, int]:
    ideal = total = 0
    async with httpx.AsyncClient(timeout=600) as c:

        async def chat(i: int) -> tuple[int, int]:
            r = random.Random(rng.random())
            ids = tok.encode(f"System: assistant {i}. " + text(r, 150))
            prev: list[int] | None = None
            ideal_i = total_i = 0
            for _ in range(r.randint(4, 8)):
                ids = ids + tok.encode(f"\nUser: {text(r, 12)}\nAssistant:")
                total_i += len(ids)
                if prev is not None:
                    ideal_i += (
                        min(common_blocks(prev, ids, args.block_size), (len(ids) - 1) // args.block_size)
                        * args.block_size
                    )
                out = await run.one(c, ids)
                prev = ids
                ids = ids + tok.encode(out, add_special_tokens=False)
            return ideal_i, total_i

        for a, b in await asyncio.gather(*(chat(i) for i in range(args.chats))):
            ideal, total = ideal + a, total + b
    return ideal, total


WORKLOADS = {"multi-tenant": multi_tenant, "multi-turn": multi_turn, "hot-tenant": hot_tenant}


def policy_config(policy: str, args) -> dict:
    """AppConfig fields of a policy name: a routing policy alone (no offload tier, no fetch from
    peers), or `cache-aware+tiers`."""
    if policy == "cache-aware+tiers":
        return {"routing": "cache-aware", "kv_offload_bytes": args.offload_mib << 20, "kv_peer_fetch": "auto"}
    return {"routing": policy, "kv_peer_fetch": "off"}


def measure(policy: str, args, tok) -> list[dict]:
    from ray import serve

    from router.app import build_app
    from router.config import AppConfig

    cfg = AppConfig(
        dtype="float32",
        num_replicas=3,
        kv_cache_memory_bytes=args.kv_mib << 20,
        num_threads=1,
        cpus_per_worker=1.0,
        block_size=args.block_size,
        **policy_config(policy, args),
    )
    handle = serve.run(build_app(cfg), name="bench", route_prefix="/")
    url = f"http://127.0.0.1:{args.port}"
    rows = []
    try:
        for name in args.workloads:
            fn = WORKLOADS[name]
            before = handle.replica_stats.remote().result()
            dec0 = handle.routing_stats.remote().result()
            run = Run(url, args.max_tokens)
            t0 = time.perf_counter()
            ideal, total = asyncio.run(fn(run, tok, args, random.Random(args.seed)))
            wall = time.perf_counter() - t0
            after = handle.replica_stats.remote().result()
            dec1 = handle.routing_stats.remote().result()
            hits = sum(s["prefix_cache_hits"] for s in after) - sum(s["prefix_cache_hits"] for s in before)
            queries = sum(s["prefix_cache_queries"] for s in after) - sum(s["prefix_cache_queries"] for s in before)
            n_dec = dec1["decisions"] - dec0["decisions"]

            def delta(key: str) -> int:
                return sum(s.get(key, 0) for s in after) - sum(s.get(key, 0) for s in before)

            rows.append(
                {
                    "policy": policy,
                    "workload": name,
                    "requests": len(run.ttft),
                    "hit_rate": hits / queries if queries else 0.0,
                    # Of the hits, loaded from the offload tier; and prompt tokens fetched from peers.
                    "offload_hit_rate": delta("prefix_cache_hits_offload") / queries if queries else 0.0,
                    "peer_fetched_rate": delta("kv_peer_tokens_fetched") / queries if queries else 0.0,
                    "ideal_hit_rate": ideal / total if total else 0.0,
                    "ttft_p50_s": statistics.median(run.ttft),
                    "ttft_p99_s": pct(run.ttft, 0.99),
                    "output_tok_s": run.out_tokens / wall,
                    "decision_us": 1e6 * (dec1["decision_seconds"] - dec0["decision_seconds"]) / n_dec
                    if n_dec
                    else 0.0,
                }
            )
    finally:
        serve.delete("bench")
    return rows


def plot(rows: list[dict], path: str) -> None:
    """Hit rate (against the ideal) and TTFT p50/p99 per policy, one column per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 7), squeeze=False)
    for j, w in enumerate(workloads):
        rs = [r for r in rows if r["workload"] == w]
        names = [r["policy"] for r in rs]
        ax = axes[0][j]
        ax.bar(names, [100 * r["hit_rate"] for r in rs], color="tab:blue")
        ax.axhline(100 * rs[0]["ideal_hit_rate"], color="k", ls="--", label="ideal")
        ax.set_title(f"{w}: prefix-cache hit rate (%)")
        ax.legend()
        ax = axes[1][j]
        x = range(len(rs))
        ax.bar([i - 0.2 for i in x], [r["ttft_p50_s"] for r in rs], width=0.4, label="p50")
        ax.bar([i + 0.2 for i in x], [r["ttft_p99_s"] for r in rs], width=0.4, label="p99")
        ax.set_xticks(list(x), names)
        ax.set_title(f"{w}: TTFT (s)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="cache-aware,least-loaded,round-robin")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-words", type=int, default=700, help="~1,000 tokens")
    p.add_argument("--turns", type=int, default=6, help="user turns per tenant")
    p.add_argument("--chats", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-mib", type=int, default=512, help="KV cache per replica")
    p.add_argument("--offload-mib", type=int, default=2048, help="disk tier per replica (cache-aware+tiers)")
    p.add_argument("--hot-requests", type=int, default=12, help="hot-tenant requests sent at once")
    p.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS), help="comma-separated")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows here too")
    p.add_argument("--plot", default=None, help="write a PNG of hit rates and TTFT here")
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
        for policy in args.policies.split(","):
            rows += measure(policy, args, tok)
            print(json.dumps(rows[-len(args.workloads) :]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(
        "\n| workload | policy | requests | hit rate | of it from the tier | fetched from peers | ideal | "
        "TTFT p50 s | TTFT p99 s | output tok/s | decision µs |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["workload"], r["policy"])):
        print(
            f"| {r['workload']} | {r['policy']} | {r['requests']} | {r['hit_rate']:.1%} | {r['offload_hit_rate']:.1%} | "
            f"{r['peer_fetched_rate']:.1%} | {r['ideal_hit_rate']:.1%} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | "
            f"{r['output_tok_s']:.1f} | {r['decision_us']:.0f} |"
        )
    plain = {r["workload"]: r for r in rows if r["policy"] == "cache-aware"}
    for r in rows:
        if r["policy"] == "cache-aware+tiers" and r["workload"] in plain:
            b = plain[r["workload"]]
            print(
                f"{r['workload']}: TTFT cache-aware / cache-aware+tiers = p50 {b['ttft_p50_s'] / r['ttft_p50_s']:.2f}x, "
                f"p99 {b['ttft_p99_s'] / r['ttft_p99_s']:.2f}x"
            )
    base = {(r["workload"]): r for r in rows if r["policy"] == "least-loaded"}
    for r in rows:
        if r["policy"] == "cache-aware" and r["workload"] in base:
            b = base[r["workload"]]
            print(f"{r['workload']}: TTFT p50 least-loaded / cache-aware = {b['ttft_p50_s'] / r['ttft_p50_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
