"""Prompt processing (prefill) speed on fresh prompts: Orbital's engine against llama.cpp's server.

    python -m bench.bench_prefill --llama-server /path/to/llama-server [--quantization gguf] [--rounds 3]

Why: `bench_llamacpp` at concurrency 1 sends the same few prompts again, and llama.cpp reuses a
slot's whole cached prompt token for token while Orbital's prefix cache reuses whole 16-token
blocks, so its TTFT column there says little about prompt speed. Here every prompt is new
(random words, Orbital's prefix caching off, llama.cpp's `cache_prompt` false), one at a time.
Orbital: the offline engine in this process, the wall time of a 1-token `generate` (prefill and
one sampled token). llama.cpp: its own `timings.prompt_ms` (prompt evaluation only, no HTTP), so
the comparison leans its way. Same threads, same GGUF (the embedded Q4_1 by default). Medians of
`--rounds` alternating rounds; the ratio is Orbital's tokens/s over llama.cpp's.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import httpx

from bench.bench_llamacpp import BUILD_HINT, free_port
from bench.bench_routing import text as prompt  # random words: a fresh prompt each call
from loadtest.server import ServerProcess
from loadtest.tokens import embedded_gguf_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the embedded Q4_1)")
    p.add_argument("--quantization", default="gguf", help="Orbital's weights ('none': the model dtype)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--words", default="64,256,512", help="prompt lengths in words (~1 token each)")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    if not a.llama_server:
        print(BUILD_HINT)
        return 0
    from engine import LLM, SamplingParams

    llm = LLM(
        quantization=None if a.quantization == "none" else a.quantization,
        dtype=a.dtype,
        num_threads=a.threads,
        enable_prefix_caching=False,
    )
    one = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(0)
    llm.generate([prompt(rng, 32)], one)  # warm-up
    port = free_port()
    cmd = (
        f"{a.llama_server} -m {a.gguf or embedded_gguf_path()} --host 127.0.0.1 --port {port} "
        f"-t {a.threads} -tb {a.threads} -np 1 -c 4096 --no-webui"
    )
    url = f"http://127.0.0.1:{port}"
    lengths = [int(w) for w in a.words.split(",")]
    rates: dict[tuple[str, int], list[float]] = {}
    tokens: dict[int, int] = {}
    with ServerProcess(cmd, url, log_path="/tmp/bench_prefill_llama.log"), httpx.Client(timeout=600) as c:
        c.post(f"{url}/completion", json={"prompt": prompt(rng, 32), "n_predict": 1, "cache_prompt": False})
        for r in range(a.rounds):
            for w in lengths:
                t0 = time.perf_counter()
                out = llm.generate([prompt(rng, w)], one)[0]
                n = len(out.prompt_token_ids)
                tokens[w] = n
                rates.setdefault(("orbital", w), []).append(n / (time.perf_counter() - t0))
                body = {"prompt": prompt(rng, w), "n_predict": 1, "cache_prompt": False}
                t = c.post(f"{url}/completion", json=body).json()["timings"]
                rates.setdefault(("llama.cpp", w), []).append(t["prompt_n"] / t["prompt_ms"] * 1e3)
                print(
                    f"round {r} {n} tokens: orbital {rates[('orbital', w)][-1]:.0f} tok/s, "
                    f"llama.cpp {rates[('llama.cpp', w)][-1]:.0f} tok/s",
                    flush=True,
                )
    print(f"\n{a.quantization} weights, {a.threads} threads, medians of {a.rounds} rounds\n")
    print("| prompt tokens | Orbital tok/s | llama.cpp tok/s | ratio |")
    print("|---|---|---|---|")
    for w in lengths:
        o, ll = (statistics.median(rates[(s, w)]) for s in ("orbital", "llama.cpp"))
        print(f"| {tokens[w]} | {o:.0f} | {ll:.0f} | {o / ll:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
