"""How idle OpenMP threads wait, side by side: passive (sleep at once), a bounded spin (the
engine's default, engine/__init__.py) and unbounded spinning (OMP_WAIT_POLICY=ACTIVE).

    python -m bench.bench_omp_wait [--model-kwargs '{"quantization": "gguf"}'] [--rounds 3]

Each setting runs in fresh processes (libgomp reads its environment once, when it loads), with
2 torch threads, on the embedded model:
- one stream: decode ms per token through `AsyncEngine` (the serving engine's step thread);
- batch: output tokens/s of 64 requests x 64 tokens through `LLM.generate`;
- two engines at once: the same batch in two processes sharing the cores (oversubscribed, as
  several replicas started with too many threads on one node would be), summed.
Rounds alternate the settings; medians, and the ratio to passive.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SETTINGS = {
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin 2000 (default)": {},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
}
PROMPT = "Write a short story about a robot who learns to paint. " * 4


def one_stream(kw: dict) -> float:
    import asyncio
    import time

    from engine.async_engine import AsyncEngine
    from engine.engine_args import EngineArgs
    from engine.sampling_params import SamplingParams

    eng = AsyncEngine(EngineArgs(num_threads=2, **kw))
    gaps: list[float] = []

    async def stream(record: bool) -> None:
        last = None
        async for _ in eng.generate(PROMPT, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)):
            now = time.perf_counter()
            if record and last is not None:
                gaps.append(now - last)
            last = now

    async def main() -> None:
        await stream(False)  # warm-up
        for _ in range(3):
            await stream(True)

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()
    return statistics.median(gaps) * 1e3


def batch(kw: dict) -> float:
    import time

    from engine import LLM, SamplingParams

    llm = LLM(num_threads=2, **kw)
    prompts = [f"Request {i}: tell me about the number {i * 7} and its history. " * (1 + i % 5) for i in range(64)]
    sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    llm.generate(prompts[:8], sp, use_tqdm=False)
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    return 64 * 64 / (time.perf_counter() - t)


def child(kind: str, kw: str) -> None:
    value = one_stream(json.loads(kw)) if kind == "stream" else batch(json.loads(kw))
    print(json.dumps({"value": value}))


def run_children(env: dict, kind: str, kw: str, copies: int) -> float:
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    full.update(env)
    cmd = [sys.executable, "-m", "bench.bench_omp_wait", "--child", kind, "--model-kwargs", kw]
    procs = [subprocess.Popen(cmd, env=full, stdout=subprocess.PIPE, text=True) for _ in range(copies)]
    values = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise RuntimeError(f"child {kind} failed ({p.returncode})")
        values.append(json.loads(out.strip().splitlines()[-1])["value"])
    return sum(values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-kwargs", default='{"quantization": "gguf"}', help="LLM keywords as JSON")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a.child, a.model_kwargs)
        return 0
    measures = {"one stream ms/token": ("stream", 1), "batch tok/s": ("batch", 1), "two engines tok/s": ("batch", 2)}
    results: dict[tuple[str, str], list[float]] = {}
    for r in range(a.rounds):
        for name, env in SETTINGS.items():
            for m, (kind, copies) in measures.items():
                v = run_children(env, kind, a.model_kwargs, copies)
                results.setdefault((name, m), []).append(v)
                print(f"round {r} {name}: {m} {v:.1f}", flush=True)
    print(f"\nmodel {a.model_kwargs}, 2 threads, medians of {a.rounds} rounds (ratio to passive)\n")
    print("| wait | " + " | ".join(measures) + " |")
    print("|---|" + "---|" * len(measures))
    for name in SETTINGS:
        cells = []
        for m in measures:
            v, base = statistics.median(results[(name, m)]), statistics.median(results[("passive", m)])
            ratio = base / v if m.endswith("ms/token") else v / base  # > 1: better than passive
            cells.append(f"{v:.1f} ({ratio:.2f}x)")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
