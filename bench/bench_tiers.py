"""Picking the model size: one app with a small and a large pool, a mixed workload served four
ways, side by side in one run: always the small pool, always the large one, the tier's rules, and
the learned classifier.

The large pool is the embedded SmolLM2-135M in float32; the small one the same checkpoint with
4-bit weights (`--small-quantization`), the cheap tier a deployment of one model family has. The
workload mixes short pattern-following prompts with small budgets (a list to continue, a phrase
to repeat) and open questions with larger ones. Quality proxy: the share of the large model's
greedy answer a request reproduces before its first different token (always-large: 100% by
definition). Cost: the share of all tokens (prompt and generated) that went through the large
pool. The classifier is trained (`python -m router.tiering train`) on a separate set of prompts
labelled offline: `small` where the small pool's greedy answer equals the large one's.

    python -m bench.bench_tiers [--requests 48 --concurrency 4 --small-quantization int4:g32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

EASY = [
    ("Continue the list: {a}, {b}, {c}, {d},", 12),
    ("Monday, Tuesday, Wednesday, Thursday, {w}", 12),
    ("Repeat after me: {p}. Repeat after me: {p}. Repeat after me:", 12),
    ("A B C D E F G H I J K", 12),
    ("The alphabet backwards: Z Y X W V U", 12),
]
HARD = [
    ("Explain in detail why {t} matters to people who live near the sea.", 40),
    ("Write a short story about {t} and a lighthouse keeper.", 40),
    ("What are the main arguments for and against {t}? Answer carefully.", 40),
    ("Describe how {t} works to a curious child, step by step.", 40),
]
TOPICS = "tides,storms,fishing,sailing,bridges,ferries,lighthouses,harbours,coral,whales,salt,fog".split(",")
PHRASES = ["the red boat sails at dawn", "keep the lamp lit", "north wind, calm sea", "ropes and anchors"]
DAYS = ["Friday,", "Friday, Saturday,"]


def workload(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2:
            tpl, budget = rng.choice(EASY)
            a = rng.randint(1, 50)
            prompt = tpl.format(a=a, b=a + 1, c=a + 2, d=a + 3, w=rng.choice(DAYS), p=rng.choice(PHRASES))
        else:
            tpl, budget = rng.choice(HARD)
            prompt = tpl.format(t=rng.choice(TOPICS))
        out.append({"prompt": prompt, "max_tokens": budget})
    return out


def offline_labels(quantization: str, rows: list[dict]) -> list[dict]:
    """Each row with `label`: small where the small pool's greedy answer equals the large's."""
    from engine import LLM, SamplingParams

    answers = {}
    for name, quant in (("small", quantization), ("large", None)):
        llm = LLM(dtype="float32", quantization=quant, num_threads=2, kv_cache_memory_bytes=256 << 20)
        try:
            params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"]) for r in rows]
            outs = llm.generate([r["prompt"] for r in rows], params, use_tqdm=False)
            answers[name] = [o.outputs[0].text for o in outs]
        finally:
            llm.shutdown()
    return [{**r, "label": "small" if s == g else "large"} for r, s, g in zip(rows, answers["small"], answers["large"])]


def pool_tokens(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        if fam.name in ("orbital:prompt_tokens", "orbital:generation_tokens"):
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["model_name"]] = out.get(s.labels["model_name"], 0.0) + s.value
    return out


async def serve_workload(url: str, model: str, rows: list[dict], concurrency: int) -> tuple[list[str], list[float]]:
    sem = asyncio.Semaphore(concurrency)
    texts, lat = [""] * len(rows), [0.0] * len(rows)

    async def one(c: httpx.AsyncClient, i: int) -> None:
        async with sem:
            t0 = time.perf_counter()
            r = await c.post("/v1/completions", json={**rows[i], "model": model, "temperature": 0})
            r.raise_for_status()
            texts[i], lat[i] = r.json()["choices"][0]["text"], time.perf_counter() - t0

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        await asyncio.gather(*(one(c, i) for i in range(len(rows))))
    return texts, lat


def agreement(got: tuple, want: tuple) -> float:
    """The share of `want`'s tokens `got` reproduces before its first different token (an empty
    answer reproduces an empty one)."""
    if not want:
        return float(not got)
    n = 0
    for a, b in zip(got, want):
        if a != b:
            break
        n += 1
    return n / len(want)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--train", type=int, default=160, help="labelled prompts for the classifier")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--small-quantization", default="int4:g32")
    ap.add_argument("--port", type=int, default=8123)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from engine.model.loader import resolve_model_dir
    from router.app import build_app
    from router.config import AppConfig
    from router.tiering.__main__ import main as train_cli

    work = Path(tempfile.mkdtemp(prefix="bench-tiers-"))
    labelled = offline_labels(args.small_quantization, workload(args.train, seed=1))
    (work / "train.jsonl").write_text("\n".join(json.dumps(r) for r in labelled) + "\n")
    print(f"training labels: {sum(r['label'] == 'small' for r in labelled)} small / {len(labelled)}")
    train_cli(
        ["train", "--data", str(work / "train.jsonl"), "--pools", "small,large", "--out", str(work / "tier.json")]
    )
    rows = workload(args.requests, seed=2)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))

    cfg = AppConfig(
        dtype="float32",
        num_threads=1,
        kv_cache_memory_bytes=256 << 20,
        models=[{"name": "small", "quantization": args.small_quantization}, {"name": "large"}],
        aliases={"rules": ["small", "large"], "learned": ["small", "large"]},
        tier_routing={
            "rules": {"rules": [{"pool": "large", "min_max_tokens": 32}]},  # longer answers: the large model
            "learned": {"classifier": str(work / "tier.json")},
        },
    )
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    results = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(cfg), name="bench", route_prefix="/")
        url = f"http://127.0.0.1:{args.port}"
        asyncio.run(serve_workload(url, "large", rows[:4], args.concurrency))  # warm both pools
        asyncio.run(serve_workload(url, "small", rows[:4], args.concurrency))
        for policy in ("large", "small", "rules", "learned"):
            before = pool_tokens(url)
            texts, lat = asyncio.run(serve_workload(url, policy, rows, args.concurrency))
            texts = [tuple(tokenizer(t).input_ids) for t in texts]
            after = pool_tokens(url)
            used = {k: after[k] - before.get(k, 0.0) for k in after}
            results[policy] = (texts, lat, used["large"] / max(sum(used.values()), 1.0))
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    reference = results["large"][0]
    names = {"large": "always large", "small": "always small", "rules": "rules", "learned": "learned classifier"}
    print(f"\n{args.requests} requests, {args.concurrency} at a time; small = {args.small_quantization} weights")
    print(
        "| policy | tokens through the large pool | share of the large model's answer reproduced | latency p50 / p95 (s) |"
    )
    print("|---|---|---|---|")
    for policy, (texts, lat, share) in results.items():
        quality = statistics.mean(agreement(t, r) for t, r in zip(texts, reference))
        p50, p95 = statistics.median(lat), pct(lat, 0.95)
        print(f"| {names[policy]} | {share:.0%} | {quality:.0%} | {p50:.2f} / {p95:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
