"""How well the watermark is detected, how often plain text is flagged, and what it costs in
quality, on the embedded model.

    python -m bench.bench_watermark [--requests 48] [--tokens 100 200] [--threshold 4] [--threads 2]

The same prompts are sampled (temperature 1, one seed each) with and without the watermark
(TGI's gamma 0.5 and delta 2.0 by default), for each output length. Prints, per length: the share
of watermarked outputs whose z-score passes the threshold (detection rate), the share of plain
outputs that pass it (false positives), the median z of each, and the perplexity of both sets of
outputs under the model without the watermark (the quality cost: how much less likely the
watermarked text is to the model that wrote it).
"""

from __future__ import annotations

import argparse
import math
import statistics

TOPICS = [
    "the sea", "a city at night", "an old library", "winter in the mountains", "a robot learning to paint",
    "the history of bread", "a lighthouse keeper", "a trip to the market", "a rainy afternoon", "the moon",
    "a chess tournament", "a garden in spring",
]  # fmt: skip


def _perplexity(llm, prompts_ids, outputs, SamplingParams) -> float:
    """exp(mean NLL) of the output tokens under the unwatermarked model, prompts as context."""
    nll, n = 0.0, 0
    batch = [{"prompt_token_ids": p + o} for p, o in zip(prompts_ids, outputs)]
    scored = llm.generate(batch, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for out, p in zip(scored, prompts_ids):
        lps = out.prompt_logprobs[len(p) :]
        nll -= sum(lp.logprob for lp in lps)
        n += len(lps)
    return math.exp(nll / n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--tokens", type=int, nargs="+", default=[100, 200])
    ap.add_argument("--threshold", type=float, default=4.0)
    ap.add_argument("--gamma", type=float, default=0.5)
    ap.add_argument("--delta", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)

    from engine import LLM, SamplingParams
    from engine.watermark import Watermark, detect

    wm = Watermark(key=20231, gamma=a.gamma, delta=a.delta)
    llm = LLM(dtype="float32", num_threads=a.threads, max_model_len=512, kv_cache_memory_bytes=256 << 20)
    try:
        prompts = [f"Write a few paragraphs about {TOPICS[i % len(TOPICS)]} (take {i})." for i in range(a.requests)]
        prompt_ids = [llm.engine.tokenizer(p).input_ids for p in prompts]
        print(f"gamma {a.gamma}, delta {a.delta}, {a.requests} prompts, z threshold {a.threshold}")
        print(
            "| tokens | detected (watermarked) | flagged (plain) | median z marked / plain | perplexity marked / plain |"
        )
        print("|---|---|---|---|---|")
        for tokens in a.tokens:
            sets = {}
            for name, mark in (("marked", wm), ("plain", None)):
                params = [
                    SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=tokens, ignore_eos=True, watermark=mark)
                    for i in range(a.requests)
                ]
                outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
                sets[name] = [o.outputs[0].token_ids for o in outs]
            z = {k: [detect(t, wm).z_score for t in v] for k, v in sets.items()}
            hit = sum(x > a.threshold for x in z["marked"]) / a.requests
            false = sum(x > a.threshold for x in z["plain"]) / a.requests
            ppl = {k: _perplexity(llm, prompt_ids, v, SamplingParams) for k, v in sets.items()}
            print(
                f"| {tokens} | {hit:.0%} | {false:.0%} | {statistics.median(z['marked']):.1f} / "
                f"{statistics.median(z['plain']):.1f} | {ppl['marked']:.2f} / {ppl['plain']:.2f} |"
            )
    finally:
        llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
