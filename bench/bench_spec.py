"""Speculative decoding (n-gram, draft model, self-drafting) vs off: same model, same cores, one run.

At concurrency 1, 4, 16, 64 (closed loop: a finished request is replaced at once) on
(a) input-grounded prompts: summarise / edit / quote a passage given in the prompt (built here,
deterministically), greedy, and (b) loadtest's mixed workload (`loadtest.workloads`, outputs
forced to --mixed-output tokens with ignore_eos, greedy). Both modes produce the same tokens,
so tokens/s compares like with like. Reports output tokens/s, TPOT p50 (per request:
(finish - first token) / (tokens - 1)), acceptance rate, mean accepted length, ratio vs off.

    python -m bench.bench_spec                       # the table in docs/speculative-decoding.md
    python -m bench.bench_spec --concurrency 1 4 --spec ngram:3
    python -m bench.bench_spec --spec ngram:4 'self:4:{"draft_quantization": "int8"}' \
        'self:4:{"draft_layers": 10}' draft:4:target

A mode is `method:k`, then optionally `:` and a draft model path ("target": the target itself,
which accepts every greedy draft) or `:` and a JSON object of further speculative_config keys.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from engine import LLM, SamplingParams
from loadtest import textgen, workloads
from loadtest.tokens import HFTokenCounter

TASKS = (
    "Repeat the following text exactly, word for word:",
    "Quote the first three sentences of this text verbatim:",
    "Fix the spelling and punctuation of this text and return the corrected text in full:",
    "Summarise this text, reusing its own wording:",
)


def grounded_prompts(llm: LLM, n: int, seed: int = 0) -> list[list[int]]:
    """Chat prompts asking to quote / edit / summarise a passage of 80-160 words given in them."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        passage = " ".join(textgen.words(rng, rng.randint(80, 160)))
        msg = f"{TASKS[i % len(TASKS)]}\n\n{passage}"
        out.append(llm.engine.inputs.tokenize_chat([{"role": "user", "content": msg}])[1])
    return out


def mixed_prompts(llm: LLM, n: int, output_tokens: int, seed: int = 0) -> list[list[int]]:
    cfg = workloads.WorkloadConfig("mixed", num_requests=n, seed=seed, output_tokens=output_tokens)
    tok = llm.tokenizer
    return [workloads.token_ids(s, tok)[:1500] for s in workloads.build(cfg, HFTokenCounter(tok, "model"))]


def run(llm: LLM, prompts: list[list[int]], sp: SamplingParams, concurrency: int) -> dict:
    """Closed loop at `concurrency`; returns tokens/s, TPOT p50 and the spec counters' deltas."""
    eng = llm.engine
    before = llm.stats()
    queue = list(prompts)
    first: dict[str, float] = {}
    tpots, tokens, live = [], 0, 0
    t0 = time.perf_counter()
    while queue or live:
        while queue and live < concurrency:
            eng.add_request(None, {"prompt_token_ids": queue.pop(0)}, sp)
            live += 1
        for out in eng.step():
            now = time.perf_counter()
            c = out.outputs[0]
            if c.token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                live -= 1
                n = len(c.token_ids)
                tokens += n
                if n > 1:
                    tpots.append((now - first[out.request_id]) / (n - 1))
    wall = time.perf_counter() - t0
    after = llm.stats()
    drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
    dtok = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    acc = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    return {
        "tok_s": tokens / wall,
        "tpot_ms": 1e3 * statistics.median(tpots) if tpots else float("nan"),
        "accept": acc / dtok if dtok else 0.0,
        "mean_len": 1 + acc / drafts if drafts else 1.0,
        "tokens": tokens,
    }


def spec_config(mode: str, target: str) -> dict:
    """`method:k[:model path | "target" | JSON of more keys]` -> a speculative_config dict."""
    method, k, extra = (mode.split(":", 2) + ["", ""])[:3]
    cfg = {"method": method, "num_speculative_tokens": int(k or 3)}
    if extra.startswith("{"):
        cfg.update(json.loads(extra))
    elif extra:
        cfg["model"] = target if extra == "target" else extra
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spec", nargs="+", default=["ngram:4"], help="modes to compare with off (see above)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--workloads", nargs="+", default=["grounded", "mixed"], choices=["grounded", "mixed"])
    ap.add_argument("--grounded-output", type=int, default=96)
    ap.add_argument("--mixed-output", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    common = dict(dtype=a.dtype, num_threads=a.threads, max_model_len=2048, max_num_seqs=max(a.concurrency))
    engines = {"off": LLM(a.model, **common)}
    llm0 = engines["off"]
    target = str(llm0.engine.model_config.model_dir)
    for mode in a.spec:
        t = time.perf_counter()
        engines[mode] = LLM(a.model, speculative_config=spec_config(mode, target), **common)
        print(f"{mode}: start-up incl. verify/draft cost measurement {time.perf_counter() - t:.1f} s", flush=True)
    loads = {
        "grounded": (
            lambda c: grounded_prompts(llm0, min(max(4, 2 * c), 64)),
            SamplingParams(temperature=0, max_tokens=a.grounded_output),
        ),
        "mixed": (
            lambda c: mixed_prompts(llm0, min(max(4, 2 * c), 64), a.mixed_output),
            SamplingParams(temperature=0, max_tokens=a.mixed_output, ignore_eos=True),
        ),
    }
    print("| workload | conc | mode | tok/s | TPOT p50 ms | accept rate | mean acc len | vs off |")
    print("|---|---|---|---|---|---|---|---|")
    for load in a.workloads:
        make, sp = loads[load]
        for c in a.concurrency:
            prompts = make(c)
            res = {}
            for mode, llm in engines.items():
                run(llm, prompts[: min(2, len(prompts))], sp, c)  # warm-up (shapes, caches)
                llm.engine.core.scheduler.reset_prefix_cache()  # both modes start cold
                res[mode] = r = run(llm, prompts, sp, c)
                ratio = r["tok_s"] / res["off"]["tok_s"]
                spec_cols = f"{r['accept']:.2f} | {r['mean_len']:.2f}" if mode != "off" else "- | -"
                print(
                    f"| {load} | {c} | {mode} | {r['tok_s']:.1f} | {r['tpot_ms']:.1f} | {spec_cols} | {ratio:.2f}x |",
                    flush=True,
                )
            for mode in a.spec:
                assert res["off"]["tokens"] == res[mode]["tokens"], f"{mode} changed the output"
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
