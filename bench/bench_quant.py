"""Weight formats side by side on the embedded model: float32, bfloat16, int8 (float32 and
bfloat16 activations), int4 quantized at load (group 32 and 128) and the GGUF's own Q4_1 blocks
(its Q8_0 tied embedding/head included) loaded as they are; the quantized ones start from their
saved quantized checkpoint (a warm-up start writes it). Each weight format runs with the float KV
cache (the model's dtype) and the int8 one (`--kv auto int8`). Each configuration runs in its own
process (so resident memory is its own), in interleaved rounds; medians of the rounds are printed.

    python -m bench.bench_quant --rounds 3
    python -m bench.bench_quant --gguf model-Q4_K_M.gguf --configs float32 ...  # + that file's rows

`--gguf` adds another file (a Q4_K_M one from `llama-quantize`) as its own blocks and as float32
of its dequantized values; "peak RSS at load" is the process's high-water mark after loading.

Per configuration: single-stream decode (one prompt, `--c1-tokens` forced tokens: tokens/s and
ms per token), a batch of `--requests` requests of loadtest's mixed-length `uniform` workload
(output tokens/s), resident memory after load (VmRSS, the 256 MiB KV pool included), KV tokens
per GiB of pool (from stats()), and perplexity on a CPython reference page
(`pydoc_data.topics["assignment"]`, 2000 tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time

CONFIGS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "int8 (f32 act)": dict(dtype="float32", quantization="int8"),
    "int8 (bf16 act)": dict(dtype="bfloat16", quantization="int8"),
    "int4 g32": dict(dtype="float32", quantization="int4:g32"),
    "int4 g128": dict(dtype="float32", quantization="int4:g128"),
    "GGUF Q4_1 as loaded": dict(dtype="float32", quantization="gguf"),
}


def add_gguf_configs(path: str) -> None:
    """Another GGUF (e.g. a Q4_K_M file) as its own blocks and as float32 of its dequantized values."""
    name = path.rsplit("/", 1)[-1].removesuffix(".gguf")
    CONFIGS[f"{name} as loaded"] = dict(model=path, dtype="float32", quantization="gguf")
    CONFIGS[f"{name} int8 activations"] = dict(model=path, dtype="float32", quantization="gguf", int8_activations=True)
    CONFIGS[f"{name} dequantized (float32)"] = dict(model=path, dtype="float32")


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


KV_BYTES = 256 << 20


def run_one(name: str, kv: str, c1_tokens: int, requests: int, threads: int) -> dict:
    from pydoc_data.topics import topics

    from engine import LLM, SamplingParams
    from loadtest import workloads
    from loadtest.tokens import HFTokenCounter

    llm = LLM(
        num_threads=threads, kv_cache_memory_bytes=KV_BYTES, max_model_len=2048, kv_cache_dtype=kv, **CONFIGS[name]
    )
    rss, peak = _rss_mb(), _peak_rss_mb()
    kv_tokens_per_gib = llm.stats()["kv_capacity_tokens"] * (1 << 30) / KV_BYTES
    tok = llm.tokenizer
    one = SamplingParams(temperature=0, max_tokens=c1_tokens, ignore_eos=True)
    llm.generate(["Warm-up."], SamplingParams(max_tokens=4), use_tqdm=False)
    t = time.perf_counter()
    llm.generate(["Tell me a story about a lighthouse keeper."], one, use_tqdm=False)
    c1 = time.perf_counter() - t
    specs = workloads.build(
        workloads.WorkloadConfig("uniform", num_requests=requests, seed=0, output_tokens=64),
        HFTokenCounter(tok, "smollm2"),
    )
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([s.prompt for s in specs], params, use_tqdm=False)
    batch = time.perf_counter() - t
    ids = tok(topics["assignment"]).input_ids[:2000]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    nll = [-lp.logprob for lp in out.prompt_logprobs[1:]]
    llm.shutdown()
    return {
        "c1_tok_s": c1_tokens / c1,
        "c1_ms_per_token": 1e3 * c1 / c1_tokens,
        "batch_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / batch,
        "rss_mb": rss,
        "peak_load_rss_mb": peak,
        "kv_tokens_per_gib": kv_tokens_per_gib,
        "perplexity": math.exp(sum(nll) / len(nll)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gguf", default=None, help="another GGUF file to add, as loaded and dequantized")
    p.add_argument("--configs", nargs="+", default=None, help=f"default: all of {list(CONFIGS)} (+ --gguf's)")
    p.add_argument("--kv", nargs="+", default=["auto", "int8"], choices=["auto", "int8"])
    p.add_argument("--c1-tokens", type=int, default=96)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process: one config
    a = p.parse_args(argv)
    if a.gguf:
        add_gguf_configs(a.gguf)
    a.configs = a.configs or list(CONFIGS)
    unknown = set(a.configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; choose from {list(CONFIGS)}")
    extra = ["--gguf", a.gguf] if a.gguf else []
    if a.one:
        print(json.dumps(run_one(a.one, a.kv[0], a.c1_tokens, a.requests, a.threads)))
        return 0
    runs: dict[tuple[str, str], list[dict]] = {(c, kv): [] for c in a.configs for kv in a.kv}
    for c in a.configs:  # the first start of a quantized configuration saves its checkpoint
        if "quantization" in CONFIGS[c]:
            subprocess.run(
                [sys.executable, "-m", "bench.bench_quant", "--one", c, "--c1-tokens", "4", "--requests", "1", *extra],
                capture_output=True,
                check=True,
            )
    for r in range(a.rounds):
        for c, kv in runs:
            cmd = [sys.executable, "-m", "bench.bench_quant", "--one", c, "--kv", kv, "--c1-tokens", str(a.c1_tokens)]
            cmd += ["--requests", str(a.requests), "--threads", str(a.threads), *extra]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[c, kv].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r + 1} {c} kv={kv}: {runs[c, kv][-1]}", file=sys.stderr)
    med = {key: {k: statistics.median(x[k] for x in v) for k in v[0]} for key, v in runs.items()}
    first = next(iter(med))
    base = med[first]
    print(
        f"| weights | KV | c1 tok/s | c1 ms/token | batch of {a.requests} tok/s | RSS MB | peak RSS at load MB "
        f"| KV tokens/GiB | perplexity | batch vs {first[0]} {first[1]} |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (c, kv), m in med.items():
        print(
            f"| {c} | {kv} | {m['c1_tok_s']:.1f} | {m['c1_ms_per_token']:.1f} | {m['batch_tok_s']:.1f} "
            f"| {m['rss_mb']:.0f} | {m['peak_load_rss_mb']:.0f} | {m['kv_tokens_per_gib']:.0f} | {m['perplexity']:.3f} "
            f"| {m['batch_tok_s'] / base['batch_tok_s']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
