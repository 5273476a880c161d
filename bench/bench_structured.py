"""What a structured output costs: the same requests with their JSON schema and without it.

    python -m bench.bench_structured [--dtype auto] [--threads 2] [--requests 32] [--rounds 3]

Each round first runs the constrained requests (a JSON schema of a few typed fields, greedy,
all at once and then one at a time), then the same prompts unconstrained with `ignore_eos` and
`max_tokens` set to each constrained output's token count, so both sides generate exactly as
many tokens from the same prompts; the order alternates between rounds. Prints output tokens/s
of both, their ratio (medians of the rounds), and what llguidance alone takes per token: a
fresh matcher replays the constrained outputs (one mask and one consumed token per position).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "email", "hobbies", "employed"],
    "additionalProperties": False,
}
TOPICS = ["a teacher", "a pilot", "a chef", "a farmer", "a painter", "a doctor", "a miner", "a poet"]


def prompts(tokenizer, n: int) -> list[str]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Invent {TOPICS[i % len(TOPICS)]} number {i} and describe them as JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(n)
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--c1-requests", type=int, default=4, help="requests sent one at a time")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    from engine import LLM, SamplingParams, StructuredOutput

    llm = LLM(dtype=a.dtype, num_threads=a.threads)
    texts = prompts(llm.tokenizer, a.requests)
    so = StructuredOutput("json", SCHEMA)
    constrained = SamplingParams(temperature=0, max_tokens=160, structured_output=so)
    llm.generate(texts[:2], constrained, use_tqdm=False)  # warm-up (builds the grammar tokenizer)

    def timed(batch: list[str], params) -> tuple[float, list]:
        """Wall seconds of `batch` all at once, or (c1) one request at a time."""
        t0, outs = time.perf_counter(), []
        for group in [batch] if load == "all" else [[t] for t in batch]:
            ps = params if isinstance(params, SamplingParams) else params[len(outs) : len(outs) + len(group)]
            outs += llm.generate(group, ps, use_tqdm=False)
        return time.perf_counter() - t0, outs

    loads = {"all": texts, "c1": texts[: a.c1_requests]}
    counts, outs = {}, {}
    for load, batch in loads.items():  # greedy: every round makes these very tokens
        _, outs[load] = timed(batch, constrained)
        counts[load] = [len(o.outputs[0].token_ids) for o in outs[load]]
    results: dict[str, list[float]] = {}
    for r in range(a.rounds):
        for load, batch in loads.items():
            free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in counts[load]]
            rate = {}
            for side in ("constrained", "free") if r % 2 == 0 else ("free", "constrained"):
                secs, got = timed(batch, constrained if side == "constrained" else free)
                # (bf16 greedy outputs can differ by batch, so each side counts its own tokens)
                rate[side] = sum(len(o.outputs[0].token_ids) for o in got) / secs
            results.setdefault(f"{load} constrained", []).append(rate["constrained"])
            results.setdefault(f"{load} free", []).append(rate["free"])
            results.setdefault(f"{load} ratio", []).append(rate["constrained"] / rate["free"])

    # llguidance alone: a fresh matcher per output, one mask and one token per position.
    import torch

    matcher_of = llm.engine.inputs.grammar_tokenizer.matcher
    per_token = []
    for o in outs["all"]:
        ids = o.outputs[0].token_ids
        m = matcher_of(so.grammar, "bench")
        t0 = time.perf_counter()
        for t in ids:
            m.bitmasks([])
            m.accept(t)
        per_token.append((time.perf_counter() - t0) / max(1, len(ids)))
    valid = sum(o.outputs[0].finish_reason == "stop" for o in outs["all"])
    print(f"torch threads {torch.get_num_threads()}, dtype {llm.engine.model_config.dtype}, rounds {a.rounds}")
    print(f"{valid}/{len(outs['all'])} constrained outputs ended by their grammar (the rest hit max_tokens)")
    print("| load | constrained tok/s | unconstrained tok/s | ratio |")
    print("|---|---|---|---|")
    for load in ("c1", "all"):
        c, f, ratio = (statistics.median(results[f"{load} {k}"]) for k in ("constrained", "free", "ratio"))
        print(f"| {load} | {c:.1f} | {f:.1f} | {ratio:.2f}x |")
    print(f"llguidance mask + consume per token: median {1e6 * statistics.median(per_token):.0f} us")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
