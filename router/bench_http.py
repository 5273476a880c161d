"""HTTP throughput vs the offline engine on the same seeded workload, in one run.

    python -m router.bench_http                       # mixed workload, 64 requests, concurrency 32
    python -m router.bench_http --num-requests 32 --max-output 64 --stream

1. Offline: `LLM.generate` over every prompt, with max_num_seqs = the HTTP concurrency (the
   same batch bound), ignore_eos so both sides produce exactly the same number of tokens.
2. HTTP: a local Ray cluster + the Serve app; `concurrency` clients send the same prompts to
   /v1/completions (streamed or not). Output tokens/s (by the server's usage) over wall time.
3. Router overhead per streamed token: one streamed request alone vs the offline engine
   decoding one sequence alone (difference of per-token times).
The offline engine is shut down before Ray starts, so the two never share the CPU.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import time


def workload(n: int, seed: int, max_output: int, tokenizer) -> list[tuple[str, int]]:
    """(prompt, output tokens): loadtest's seeded mixed workload, output lengths capped."""
    try:
        from loadtest.tokens import HFTokenCounter
        from loadtest.workloads import WorkloadConfig, build

        specs = build(WorkloadConfig(name="mixed", num_requests=n, seed=seed), HFTokenCounter(tokenizer, "smollm2"))
        return [(s.prompt, min(s.max_tokens, max_output)) for s in specs]
    except ImportError:  # loadtest absent: a seeded stand-in
        import random

        rng = random.Random(seed)
        words = "the of and to in is that it for on with as was at by an be this from".split()
        return [(" ".join(rng.choice(words) for _ in range(rng.randint(20, 400))), rng.randint(16, max_output))
                for _ in range(n)]


def engine_kwargs(a) -> dict:
    return dict(dtype=a.dtype, num_threads=a.threads, kv_cache_memory_bytes=a.kv_bytes, max_num_seqs=a.concurrency)


def run_offline(a, work) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(**engine_kwargs(a))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
    llm.generate([work[0][0]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    t = time.perf_counter()
    one = llm.generate([work[0][0]], SamplingParams(temperature=0.0, max_tokens=a.single_tokens, ignore_eos=True),
                       use_tqdm=False)
    single = (time.perf_counter() - t) / len(one[0].outputs[0].token_ids)
    llm.shutdown()
    del llm
    gc.collect()
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "single_s_per_token": single}


async def _one(client, prompt: str, max_tokens: int, stream: bool) -> tuple[int, list[float]]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": stream}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"], []
    body["stream_options"] = {"include_usage": True}
    times, tokens = [], 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"]:
                times.append(time.perf_counter())
    return tokens, times


async def run_http_load(url: str, work, concurrency: int, stream: bool) -> dict:
    import httpx

    queue = list(reversed(work))
    total = 0

    async with httpx.AsyncClient(base_url=url, timeout=3600,
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        await _one(client, work[0][0], 4, stream)  # warm-up

        async def worker():
            nonlocal total
            while queue:
                prompt, m = queue.pop()
                n, _ = await _one(client, prompt, m, stream)
                total += n

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t
        _, times = await _one(client, work[0][0], 64, True)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"tokens": total, "wall_s": wall, "tok_s": total / wall,
            "single_stream_s_per_token": sum(gaps) / max(len(gaps), 1)}


def run_http(a, work) -> dict:
    import ray
    from ray import serve

    from router.app import build_app
    from router.config import AppConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=a.num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cfg = AppConfig(**{k: v for k, v in engine_kwargs(a).items() if k != "max_num_seqs"},
                        max_num_seqs=max(a.concurrency, 32), num_replicas=a.replicas,
                        cpus_per_worker=a.num_cpus / a.replicas)
        serve.run(build_app(cfg), name="bench", route_prefix="/")
        return asyncio.run(run_http_load(f"http://127.0.0.1:{port}", work, a.concurrency, a.stream))
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m router.bench_http", description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-output", type=int, default=128, help="cap on each request's output tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream", action="store_true", help="stream the HTTP responses (SSE)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--num-cpus", type=int, default=os.cpu_count() or 1)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--kv-bytes", type=int, default=1 << 30)
    p.add_argument("--single-tokens", type=int, default=64)
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)

    from transformers import AutoTokenizer

    from engine.model.loader import resolve_model_dir

    work = workload(a.num_requests, a.seed, a.max_output, AutoTokenizer.from_pretrained(resolve_model_dir(None)))
    print(f"workload: mixed, {len(work)} requests, {sum(m for _, m in work)} output tokens, "
          f"concurrency {a.concurrency}, stream={a.stream}", flush=True)
    off = run_offline(a, work)
    print(f"offline: {off['tokens']} tokens in {off['wall_s']:.1f} s = {off['tok_s']:.1f} tok/s", flush=True)
    http = run_http(a, work)
    ratio = http["tok_s"] / off["tok_s"]
    overhead_ms = (http["single_stream_s_per_token"] - off["single_s_per_token"]) * 1e3
    print(f"http:    {http['tokens']} tokens in {http['wall_s']:.1f} s = {http['tok_s']:.1f} tok/s")
    print(f"ratio http/offline: {ratio:.1%}")
    print(f"single stream: {http['single_stream_s_per_token'] * 1e3:.2f} ms/token over HTTP vs "
          f"{off['single_s_per_token'] * 1e3:.2f} ms/token offline -> router overhead {overhead_ms:.2f} ms/token")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "offline": off, "http": http, "ratio": ratio,
                       "overhead_ms_per_token": overhead_ms}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
