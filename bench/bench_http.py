"""HTTP throughput vs the offline engine on the same seeded workload, in one run.

    python -m bench.bench_http                       # mixed workload, 64 requests, concurrency 32
    python -m bench.bench_http --num-requests 32 --max-output 64 --stream

* Offline: `LLM.generate` over every prompt with max_num_seqs = the HTTP concurrency (the same
  batch bound) and ignore_eos, so both sides produce exactly the same tokens.
* HTTP: a local Ray cluster + the Serve app (same engine settings); `concurrency` clients send
  the same prompts to /v1/completions (streamed or not). Output tokens/s by the server's usage.
* The two alternate (offline pass, HTTP pass, repeated `--rounds` times) with both loaded but
  only one working, so CPU contention from elsewhere hits both alike; each gets a warm-up pass.
* Router overhead per streamed token: one request alone, streamed over HTTP, vs the offline
  engine decoding one sequence alone (best of 3 each): the difference of per-token times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time

from loadtest.tokens import HFTokenCounter
from loadtest.workloads import WorkloadConfig, build


def workload(n: int, seed: int, max_output: int, tokenizer) -> list[tuple[str, int]]:
    """(prompt, output tokens): loadtest's seeded mixed workload, output lengths capped."""
    specs = build(WorkloadConfig(name="mixed", num_requests=n, seed=seed), HFTokenCounter(tokenizer, "smollm2"))
    return [(s.prompt, min(s.max_tokens, max_output)) for s in specs]


def engine_kwargs(a) -> dict:
    return dict(dtype=a.dtype, num_threads=a.threads, kv_cache_memory_bytes=a.kv_bytes, max_num_seqs=a.concurrency)


def _offline_main(conn, kwargs: dict) -> None:
    """The offline engine in its own process (no Ray, no HTTP client beside it)."""
    from engine import LLM, SamplingParams

    llm = LLM(**kwargs)
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            llm.shutdown()
            conn.send(None)
            return
        c, t = time.process_time(), time.perf_counter()
        if cmd == "run":
            params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in arg]
            outs = llm.generate([p for p, _ in arg], params, use_tqdm=False)
            n = sum(len(o.outputs[0].token_ids) for o in outs)
        else:  # "single": (prompt, tokens)
            out = llm.generate(
                [arg[0]], SamplingParams(temperature=0.0, max_tokens=arg[1], ignore_eos=True), use_tqdm=False
            )
            n = len(out[0].outputs[0].token_ids)
        conn.send({"tokens": n, "wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c})


class Offline:
    def __init__(self, a):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_offline_main, args=(child, engine_kwargs(a)), daemon=True)
        self.proc.start()

    def _ask(self, cmd: str, arg) -> dict:
        self.conn.send((cmd, arg))
        return self.conn.recv()

    def run(self, work) -> dict:
        out = self._ask("run", list(work))
        out["tok_s"] = out["tokens"] / out["wall_s"]
        return out

    def single(self, prompt: str, n: int) -> float:
        out = self._ask("single", (prompt, n))
        return out["wall_s"] / out["tokens"]

    def close(self) -> None:
        self._ask("stop", None)
        self.proc.join(timeout=30)


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


async def http_pass(url: str, work, concurrency: int, stream: bool) -> dict:
    import httpx

    queue = list(reversed(work))
    total = 0
    async with httpx.AsyncClient(
        base_url=url, timeout=3600, limits=httpx.Limits(max_connections=concurrency + 4)
    ) as client:

        async def worker():
            nonlocal total
            while queue:
                prompt, m = queue.pop()
                n, _ = await _one(client, prompt, m, stream)
                total += n

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t
    return {"tokens": total, "wall_s": wall, "tok_s": total / wall}


async def http_single(url: str, prompt: str, n: int) -> float:
    """Seconds per token of one streamed request alone (first token excluded)."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        _, times = await _one(client, prompt, n, True)
    return (times[-1] - times[0]) / max(len(times) - 1, 1)


def start_http(a) -> str:
    import ray
    from ray import serve

    from router.app import build_app
    from router.config import AppConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(
        address="local", num_cpus=a.num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=False
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cfg = AppConfig(
        **{k: v for k, v in engine_kwargs(a).items() if k != "max_num_seqs"},
        max_num_seqs=max(a.concurrency, 32),
        num_replicas=a.replicas,
        cpus_per_worker=a.num_cpus / a.replicas,
    )
    serve.run(build_app(cfg), name="bench", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def channel_batching() -> dict:
    """Generated tokens and output-channel messages so far, all engine replicas."""
    from ray import serve

    stats = serve.get_app_handle("bench").replica_stats.remote().result()
    return {
        "tokens": sum(s.get("generation_tokens", 0) for s in stats),
        "messages": sum(s.get("channel_messages", 0) for s in stats),
    }


def stop_http() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def _sum(passes: list[dict], key: str = "wall_s") -> float:
    return sum(p["tokens"] for p in passes) / sum(p[key] for p in passes)


def _kind(cmdline: str) -> str:
    for key, kind in (
        ("EngineReplica", "engine"),
        (":Ingress", "ingress"),
        ("ProxyActor", "proxy"),
        ("ServeController", "controller"),
        ("raylet", "raylet"),
        ("gcs_server", "gcs"),
    ):
        if key in cmdline:
            return kind
    return "other"


def _server_cpu(exclude: set[int]) -> dict[str, float]:
    """CPU time (user + system) of this process's descendants but `exclude` (the local Ray
    cluster: GCS, raylet, Serve controller, proxy, ingress and engine replicas), by kind."""
    # isort: off
    import ray  # noqa: F401 - puts Ray's bundled psutil on the path
    import psutil
    # isort: on

    out: dict[str, float] = {}
    for p in psutil.Process().children(recursive=True):
        if p.pid in exclude:
            continue
        try:
            t = p.cpu_times()
            kind = _kind(" ".join(p.cmdline()))
        except psutil.Error:
            continue
        out[kind] = out.get(kind, 0.0) + t.user + t.system
    return out


def cpu_timed(fn, exclude: set[int]) -> dict:
    before = _server_cpu(exclude)
    out = fn()
    after = _server_cpu(exclude)
    by_kind = {k: round(after[k] - before.get(k, 0.0), 2) for k in after}
    out["cpu_by_process"] = by_kind
    out["cpu_s"] = sum(by_kind.values())
    out["serving_cpu_s"] = out["cpu_s"] - by_kind.get("engine", 0.0)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_http", description=__doc__.split("\n")[0])
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
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)

    from transformers import AutoTokenizer

    from engine.model.loader import resolve_model_dir

    work = workload(a.num_requests, a.seed, a.max_output, AutoTokenizer.from_pretrained(resolve_model_dir(None)))
    print(
        f"workload: mixed, {len(work)} requests, {sum(m for _, m in work)} output tokens, "
        f"concurrency {a.concurrency}, stream={a.stream}, rounds={a.rounds}",
        flush=True,
    )
    offline = Offline(a)  # its own process, started before Ray: never a Ray descendant
    url = start_http(a)
    try:
        warm = work[: min(8, len(work))]
        offline.run(warm)
        asyncio.run(http_pass(url, warm, a.concurrency, a.stream))
        off_passes, http_passes = [], []
        channel_before = channel_batching()
        for r in range(a.rounds):
            off_passes.append(offline.run(work))
            http_passes.append(
                cpu_timed(
                    lambda: asyncio.run(http_pass(url, work, a.concurrency, a.stream)), exclude={offline.proc.pid}
                )
            )
            o, h = off_passes[-1], http_passes[-1]
            print(
                f"round {r}: offline {o['tok_s']:.1f} tok/s ({o['wall_s']:.1f} s, {o['cpu_s']:.1f} CPU-s), "
                f"http {h['tok_s']:.1f} tok/s ({h['wall_s']:.1f} s, {h['cpu_s']:.1f} CPU-s of the server), "
                f"ratio {h['tok_s'] / o['tok_s']:.1%}; server CPU-s by process {h['cpu_by_process']}",
                flush=True,
            )
        channel = {k: v - channel_before[k] for k, v in channel_batching().items()}
        prompt = work[0][0]
        off_single = min(offline.single(prompt, a.single_tokens) for _ in range(3))
        http_single_s = min(asyncio.run(http_single(url, prompt, a.single_tokens)) for _ in range(3))
    finally:
        offline.close()
        stop_http()
    off_rate, http_rate = _sum(off_passes), _sum(http_passes)
    ratio = http_rate / off_rate
    cpu_ratio = _sum(http_passes, "cpu_s") / _sum(off_passes, "cpu_s")
    overhead_ms = (http_single_s - off_single) * 1e3
    print(f"offline: {off_rate:.1f} tok/s   http: {http_rate:.1f} tok/s   ratio http/offline: {ratio:.1%}")
    serving_ms = sum(p["serving_cpu_s"] for p in http_passes) / sum(p["tokens"] for p in http_passes) * 1e3
    print(
        f"router overhead: {serving_ms:.2f} CPU-ms per generated token in the proxy, router, controller "
        f"and Ray processes (everything but the engine replica)"
    )
    print(
        f"tokens per CPU-second: offline {_sum(off_passes, 'cpu_s'):.1f}, http server {_sum(http_passes, 'cpu_s'):.1f}"
        f" -> CPU-efficiency ratio {cpu_ratio:.1%} (what the wall ratio is on an otherwise idle CPU-bound box)"
    )
    print(
        f"single stream: {http_single_s * 1e3:.2f} ms/token over HTTP vs {off_single * 1e3:.2f} ms/token "
        f"offline -> router overhead {overhead_ms:.2f} ms/token"
    )
    print(
        f"output channel: {channel['tokens'] / max(channel['messages'], 1):.1f} tokens per message "
        f"({channel['messages']} messages in the HTTP passes)"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "args": vars(a),
                    "offline": off_passes,
                    "http": http_passes,
                    "ratio": ratio,
                    "cpu_ratio": cpu_ratio,
                    "serving_cpu_ms_per_token": serving_ms,
                    "single_s_per_token": {"offline": off_single, "http": http_single_s},
                    "overhead_ms_per_token": overhead_ms,
                    "channel": channel,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
