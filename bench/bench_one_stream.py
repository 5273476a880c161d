"""One-stream offline decode (`LLM.generate`, 2 threads unless `--threads`): ms per output token
with a fast path on and off, each measure a fresh process, rounds alternating the two settings;
medians.

    python -m bench.bench_one_stream --compare fused [--model-kwargs '{"quantization": "gguf"}']
    python -m bench.bench_one_stream --compare int4-op [--rounds 5] [--tokens 128]
    python -m bench.bench_one_stream --compare fused --threads 1
    python -m bench.bench_one_stream --against /path/to/another/checkout   # e.g. `git worktree add`

`fused`: the decoder layers in one C++ call (engine/model/fused_decode.py) against the layers run
as modules (ORBITAL_FUSED_DECODE=0). `int4-op`, with the layers as modules both ways: the few-row
C++ int4 op (int4_linear.cpp) against PyTorch's `_weight_int4pack_mm_for_cpu` at every row count
(ORBITAL_INT4_SMALL_LINEAR=0). `--against DIR`: this checkout against the one in DIR (a kernel
change that no switch turns off; each builds its own C++ ops on first use), default settings both.
Decode alone: a request of 1 + N output tokens minus one of 1 token (the prompt's prefill), over N.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# Two settings each (environment over the caller's); int4-op runs the layers as modules both ways.
COMPARE = {
    "fused": {"fused": {}, "layers": {"ORBITAL_FUSED_DECODE": "0"}},
    "int4-op": {
        "op on": {"ORBITAL_FUSED_DECODE": "0"},
        "op off": {"ORBITAL_FUSED_DECODE": "0", "ORBITAL_INT4_SMALL_LINEAR": "0"},
    },
}
PROMPT = "Write a short story about a robot who learns to paint. " * 4


def child(tokens: int, kw: dict, threads: int) -> float:
    import time

    from engine import LLM, SamplingParams

    llm = LLM(num_threads=threads, **kw)

    def run(n: int) -> float:
        sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([PROMPT], sp, use_tqdm=False)
        return time.perf_counter() - t

    run(tokens)  # warm-up
    full = statistics.median(run(1 + tokens) for _ in range(3))
    prefill = statistics.median(run(1) for _ in range(3))
    return (full - prefill) / tokens * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", choices=sorted(COMPARE), default="fused")
    p.add_argument("--model-kwargs", default='{"quantization": "gguf"}', help="LLM keywords as JSON")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--against", help="another checkout's folder: compare this one against it")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps({"value": child(a.tokens, json.loads(a.model_kwargs), a.threads)}))
        return 0
    settings = COMPARE[a.compare]
    here = str(Path(__file__).resolve().parents[1])
    folders = dict.fromkeys(settings, here)
    if a.against:  # python -m runs the bench module of the folder it starts in
        settings, folders = {"this": {}, "other": {}}, {"this": here, "other": str(Path(a.against).resolve())}
    ours = {k for env in settings.values() for k in env}
    results: dict[str, list[float]] = {name: [] for name in settings}
    for r in range(a.rounds):
        for name, env in settings.items():
            full = {k: v for k, v in os.environ.items() if k not in ours} | env
            if a.against:
                full["PYTHONPATH"] = folders[name]
            cmd = [sys.executable, "-m", "bench.bench_one_stream", "--child", "--tokens", str(a.tokens)]
            cmd += ["--threads", str(a.threads)]
            out = subprocess.run(
                cmd + ["--model-kwargs", a.model_kwargs], env=full, cwd=folders[name], capture_output=True, text=True
            )
            if out.returncode:
                raise RuntimeError(f"child failed: {out.stderr[-2000:]}")
            v = json.loads(out.stdout.strip().splitlines()[-1])["value"]
            results[name].append(v)
            print(f"round {r} {name}: {v:.2f} ms/token", flush=True)
    on, off = (statistics.median(results[n]) for n in settings)
    names = list(settings)
    print(f"\nmodel {a.model_kwargs}, one stream, {a.threads} threads, medians of {a.rounds} rounds")
    print(f"| {names[0]} | {names[1]} | speedup |\n|---|---|---|")
    print(f"| {on:.2f} ms/token | {off:.2f} ms/token | {off / on:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
