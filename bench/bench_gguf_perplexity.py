"""Perplexity of one GGUF file in Orbital (its own blocks, and its float dequantization) and in
llama.cpp's `llama-perplexity`, scored the way llama-perplexity scores: the text cut into chunks
of `--ctx` tokens, each chunk evaluated alone, the second half of each chunk's tokens scored.

    python -m bench.bench_gguf_perplexity --gguf model-Q4_K_M.gguf --llama-perplexity /path/to/llama-perplexity

The text is CPython's reference pages (`pydoc_data.topics`, fixed entries joined), written to a
temporary file for llama.cpp. Both tokenize it with the file's own tokenizer (Orbital through
transformers' conversion of the GGUF's vocabulary); the token counts are printed beside the
figures so a difference in tokenization shows.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import tempfile

TOPICS = ("assignment", "compound", "comparisons", "customization")


def text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[t] for t in TOPICS)


def orbital_perplexity(gguf: str, ctx: int, chunks: int, threads: int, **llm_kwargs) -> tuple[float, int]:
    """(perplexity, tokens scored) over the first `chunks` chunks of `ctx` tokens."""
    from engine import LLM, SamplingParams

    llm = LLM(gguf, num_threads=threads, kv_cache_memory_bytes=256 << 20, max_model_len=ctx + 1, **llm_kwargs)
    try:
        ids = llm.tokenizer(text()).input_ids
        parts = [ids[i * ctx : (i + 1) * ctx] for i in range(min(chunks, len(ids) // ctx))]
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in parts],
            SamplingParams(max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    # prompt_logprobs[j] scores token j given tokens < j; llama-perplexity scores tokens ctx/2..ctx-1.
    nll = [-o.prompt_logprobs[j].logprob for o in outs for j in range(ctx // 2, ctx)]
    return math.exp(sum(nll) / len(nll)), len(nll)


def llamacpp_perplexity(binary: str, gguf: str, ctx: int, chunks: int, threads: int) -> tuple[float, str]:
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text())
        f.flush()
        cmd = [binary, "-m", gguf, "-f", f.name, "-c", str(ctx), "-b", str(ctx), "--chunks", str(chunks)]
        out = subprocess.run(cmd + ["-t", str(threads)], capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    if m is None:
        raise RuntimeError(f"no final estimate in llama-perplexity's output:\n{log[-2000:]}")
    chunks_seen = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)", log)
    note = f"{chunks_seen.group(1)} chunks of {chunks_seen.group(2)} tokens" if chunks_seen else ""
    return float(m.group(1)), note


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--llama-perplexity", default=None, help="llama.cpp's llama-perplexity binary (optional)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--int8-activations", action="store_true", help="add the file's blocks on int8 activations")
    a = p.parse_args(argv)
    rows = []
    blocks, n = orbital_perplexity(a.gguf, a.ctx, a.chunks, a.threads, dtype="float32", quantization="gguf")
    rows.append(("Orbital, the file's own blocks", blocks, f"{n} tokens scored"))
    if a.int8_activations:
        kw = dict(dtype="float32", quantization="gguf", int8_activations=True)
        ppl, n = orbital_perplexity(a.gguf, a.ctx, a.chunks, a.threads, **kw)
        rows.append(("Orbital, the file's own blocks, int8 activations", ppl, f"{n} tokens scored"))
    dequant, n = orbital_perplexity(a.gguf, a.ctx, a.chunks, a.threads, dtype="float32")
    rows.append(("Orbital, the file dequantized (float32)", dequant, f"{n} tokens scored"))
    if a.llama_perplexity:
        ppl, note = llamacpp_perplexity(a.llama_perplexity, a.gguf, a.ctx, a.chunks, a.threads)
        rows.append(("llama.cpp llama-perplexity", ppl, note))
    print(f"| {a.gguf.rsplit('/', 1)[-1]}, ctx {a.ctx}, {a.chunks} chunks | perplexity | vs Orbital blocks | |")
    print("|---|---|---|---|")
    for name, ppl, note in rows:
        print(f"| {name} | {ppl:.4f} | {ppl / blocks - 1:+.2%} | {note} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
