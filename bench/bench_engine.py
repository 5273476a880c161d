"""Static batching (transformers `generate`, batches of 8) vs this engine's continuous batching.

Same model, same dtype, same seeded workload (loadtest's `uniform`: prompts 20-600 tokens,
outputs 10-500 tokens fixed per request, both drawn uniformly), in one run. Prints useful output
tokens/s of each, the ratio, the KV-cache waste and the share of this machine's matmul roof the
engine reached.

    python -m bench.bench_engine --requests 64 --dtypes float32 bfloat16
    python -m bench.bench_engine --requests 256 --hf-requests 48   # deeper queue, HF on a prefix

Static batching runs each batch of 8 on its own, so its throughput does not depend on how many
requests are queued: `--hf-requests K` runs transformers on the first K requests of the same
seeded workload (K/8 batches) and the engine on all of them, where continuous batching gains
from a deeper queue. Both figures are printed with their request counts.

The requests come from loadtest's generator (`loadtest.workloads`, workload `uniform`, lengths
in the model's own tokens), the same one the load tester sends over HTTP. Against the former
bench-only generator (a word salad cut at uniform token offsets) the length distributions are the
same; the differences: the text is loadtest's synthetic sentences, a prompt is its drawn length
or a token or two under it (cut at a word boundary), and the seeded draws differ, so a seed gives
other requests than before (same shape, so figures stay comparable).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from bench.timing import median_time
from loadtest import workloads
from loadtest.tokens import HFTokenCounter


def matmul_roof(dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    """The faster of PyTorch's matmul and the oneDNN-packed GEMM the engine uses on CPU (for
    float32 the packed one is ~2x faster here), so the share is of what this machine can do."""
    from engine.layers.packed_gemm import linear, pack_weight, packing_enabled

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    paths = [lambda: a @ b]
    if packing_enabled(dtype, torch.device("cpu")):
        packed = pack_weight(b.t())
        paths.append(lambda: linear(a, packed))
    return 2 * n**3 / min(median_time(fn, reps) for fn in paths)


def make_requests(tokenizer, n: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) of loadtest's seeded `uniform` workload."""
    cfg = workloads.WorkloadConfig("uniform", num_requests=n, seed=seed, prompt_range=(20, 600), output_range=(10, 500))
    specs = workloads.build(cfg, HFTokenCounter(tokenizer, "model"))
    return [(workloads.token_ids(s, tokenizer), s.max_tokens) for s in specs]


def run_hf_static(model, tokenizer, reqs, batch_size: int = 8) -> tuple[float, int]:
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    useful, t0 = 0, time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        longest = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([[pad] * (longest - len(p)) + p for p, _ in batch])
        mask = (torch.arange(longest)[None, :] >= torch.tensor([longest - len(p) for p, _ in batch])[:, None]).long()
        new = max(n for _, n in batch)  # a static batch runs until its longest request ends
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad
            )
        useful += sum(n for _, n in batch)
    return time.perf_counter() - t0, useful


def run_engine(llm, reqs) -> tuple[float, int, float]:
    from engine import SamplingParams

    eng = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    for (ids, _), p in zip(reqs, params):
        eng.add_request(None, {"prompt_token_ids": ids}, p)
    slots = stored = 0
    useful, t0 = 0, time.perf_counter()
    sched = eng.core.scheduler
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                useful += len(out.outputs[0].token_ids)
        kv = sched.kv_cache_manager
        for req in sched.running:  # waste = allocated slots not holding a token, summed over steps
            n = len(kv.req_to_blocks.get(req.request_id, ()))
            slots += n * kv.block_size
            stored += min(req.num_computed_tokens, n * kv.block_size)
    return time.perf_counter() - t0, useful, (slots - stored) / max(slots, 1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument(
        "--hf-requests",
        type=int,
        default=None,
        help="transformers runs the first K requests only (default: all); a multiple of 8",
    )
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-gib", type=float, default=6.0, help="KV cache budget (GiB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true", help="engine only (quick tuning runs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from engine import LLM
    from engine.model.loader import parameter_bytes

    rows = []
    for dt in args.dtypes:
        llm = LLM(
            dtype=dt,
            kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
            max_num_seqs=256,
            max_num_batched_tokens=2048,
            num_threads=args.threads,
        )
        reqs = make_requests(llm.tokenizer, args.requests, args.seed)
        model = llm.engine.core.executor.runner.model
        hc = model.config
        n_params = parameter_bytes(model) // torch.tensor([], dtype=llm.engine.model_config.dtype).element_size()
        head = hc.vocab_size * hc.hidden_size
        body = n_params - head  # embedding lookup is free; the LM head runs once per sampled token
        t_eng, useful_eng, waste = run_engine(llm, reqs)
        flops = sum(2 * body * (len(ids) + n) + 2 * head * n for ids, n in reqs)
        roof = matmul_roof(getattr(torch, dt))
        row = dict(
            dtype=dt,
            engine_tok_s=useful_eng / t_eng,
            kv_waste=waste,
            roof_share=flops / t_eng / roof,
            roof_gflops=roof / 1e9,
            engine_s=t_eng,
        )
        model_dir, tokenizer = llm.engine.model_config.model_dir, llm.tokenizer
        llm.shutdown()
        del model, llm
        gc.collect()  # the engine's KV cache and weights are released before the baseline runs
        if not args.skip_hf:
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dt)).eval()
            t_hf, useful_hf = run_hf_static(hf, tokenizer, reqs[: args.hf_requests or len(reqs)])
            row.update(hf_tok_s=useful_hf / t_hf, ratio=(useful_eng / t_eng) / (useful_hf / t_hf), hf_s=t_hf)
            del hf
        rows.append(row)
        print(row, flush=True)
    hf_n = min(args.hf_requests or args.requests, args.requests)
    print(
        f"\nuniform workload: engine {args.requests} requests, transformers the first {hf_n}; prompts 20-600, "
        f"outputs 10-500 tokens, seed {args.seed}, {args.threads} threads"
    )
    print("| dtype | HF static (b=8) tok/s | engine tok/s | ratio | KV waste | matmul roof share |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        hf = f"{r['hf_tok_s']:.1f}" if "hf_tok_s" in r else "-"
        ratio = f"{r['ratio']:.1f}x" if "ratio" in r else "-"
        print(
            f"| {r['dtype']} | {hf} | {r['engine_tok_s']:.1f} | {ratio} | {r['kv_waste']:.2%} | "
            f"{r['roof_share']:.0%} of {r['roof_gflops']:.0f} GFLOP/s |"
        )


if __name__ == "__main__":
    main()
