"""GPU benchmark: the engine against transformers' static batching on the same GPU, in one run.

For each model (random weights of a real shape, built and saved by the script: the embedded
SmolLM2-135M's shape and a ~1B Llama) and each batch size B: B requests of --prompt-len
token ids (loadtest's seeded `uniform` workload text, tokenized and cut or filled to exactly
that length; the weights are random, so only the lengths matter), greedy, exactly --output-len
new tokens each (ignore_eos), all arriving at once.
Figures: output tokens/s over the whole run, and TTFT (engine: mean over requests of the time
from arrival to their first token; transformers: one batched generate of a single token).
Each engine configuration named in --backends runs the same workload:
`backend[:eager][/weights[/kv]]`, an attention backend, `:eager` for no CUDA graphs, then
optionally weight quantization (`int8`, `int4`, `int4:g64`, `gguf`...; `-` for none; `@triton`
or `@torch` after it for the Triton or PyTorch's kernels instead of cuda_kernel_choice.py's
defaults) and the KV cache dtype (`int8`, `fp8_e4m3`). Each row also gives the KV pool's capacity in tokens and the
weights' bytes on the GPU.

    python -m bench.bench_gpu --out bench_gpu.json      # needs CUDA and a tokenizer (see bench/random_llama.py)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time

import torch


def _prompts(b: int, plen: int, tok, seed: int) -> list[list[int]]:
    """b prompts of exactly plen token ids: loadtest's seeded `uniform` workload at one length."""
    from loadtest import workloads
    from loadtest.tokens import HFTokenCounter

    cfg = workloads.WorkloadConfig(
        "uniform", num_requests=b, seed=seed, prompt_range=(plen, plen), output_range=(1, 1)
    )  # output lengths: the caller's
    return [workloads.token_ids(s, tok, plen) for s in workloads.build(cfg, HFTokenCounter(tok, "model"))]


def run_engine(llm, prompts: list[list[int]], new: int) -> dict:
    from engine import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    for p in prompts:
        eng.add_request(None, {"prompt_token_ids": p}, params)
    first: dict[str, float] = {}
    tokens = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    assert tokens == len(prompts) * new, (tokens, len(prompts) * new)
    return {"tok_s": tokens / wall, "ttft_ms": 1e3 * statistics.mean(first.values()), "wall_s": wall}


@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], new: int) -> dict:
    ids = torch.tensor(prompts, device="cuda")
    mask = torch.ones_like(ids)

    def gen(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    gen(2)  # warm-up at this batch size
    ttft = gen(1)
    wall = gen(new)
    return {"tok_s": len(prompts) * new / wall, "ttft_ms": 1e3 * ttft, "wall_s": wall}


def saved_params(path: str) -> int:
    """Parameters in a saved model's safetensors files (their headers only)."""
    import glob

    from safetensors import safe_open

    total = 0
    for f in glob.glob(f"{path}/*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                total += _numel(st.get_slice(k).get_shape())
    return total


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameters and the tensors a quantized one carries (scales, zeros, plain rows)."""
    seen, total = set(), 0
    for p in model.parameters():
        for t in [p, *p.__dict__.values()]:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def bench_model(shape: str, args) -> list[dict]:
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.random_llama import model_dir
    from engine import LLM

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dtype = getattr(torch, args.dtype)
        path = model_dir(args.model_dir or tmp, shape, dtype)
        tok = AutoTokenizer.from_pretrained(path)
        nparams = saved_params(path)
        hf = None if args.skip_hf else AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map="cuda").eval()
        for config in args.backends:
            head, *rest = config.split("/")
            backend, _, mode = head.partition(":")
            quant = rest[0] if rest and rest[0] != "-" else None
            quant, _, kernel = (quant or "").partition("@")
            quant = quant or None
            if kernel:
                os.environ["ORBITAL_CUDA_QUANT_KERNEL"] = kernel
            else:
                os.environ.pop("ORBITAL_CUDA_QUANT_KERNEL", None)  # cuda_kernel_choice's defaults
            kv = rest[1] if len(rest) > 1 else "auto"
            os.environ["ORBITAL_ATTENTION_BACKEND"] = backend
            t0 = time.perf_counter()
            llm = LLM(
                path,
                dtype=args.dtype,
                device="cuda",
                max_num_seqs=max(args.batches),
                max_num_batched_tokens=args.max_num_batched_tokens,
                enforce_eager=mode == "eager",
                gpu_memory_utilization=args.gpu_memory_utilization,
                enable_prefix_caching=False,
                quantization=quant,
                kv_cache_dtype=kv,
                **({"overlap_text": args.overlap_text == "on"} if args.overlap_text != "auto" else {}),
            )
            start_s = time.perf_counter() - t0  # load, pool sizing and graph capture
            num_blocks = llm.engine.core.executor.num_blocks
            stats = llm.stats()
            ex = llm.engine.core.executor
            kv_per_gib = round((1 << 30) / (ex.kv_bytes_per_block() / llm.engine.args.block_size))
            weight_gb = weight_bytes(llm.engine.core.executor.runner.model) / 1e9
            # Warm-up at the largest batch: kernels compile and the allocator grows to a full
            # prefill step's size before timing (else the first timed batch-256 TTFT paid for it).
            run_engine(llm, _prompts(max(args.batches), args.prompt_len, tok, 99), 8)
            for b in args.batches:
                r = run_engine(llm, _prompts(b, args.prompt_len, tok, b), args.output_len)
                rows.append(
                    {
                        "model": shape,
                        "params": nparams,
                        "system": f"engine ({config}{'' if args.overlap_text == 'auto' else ', overlap ' + args.overlap_text})",
                        "batch": b,
                        "kv_blocks": num_blocks,
                        "kv_tokens": stats["kv_capacity_tokens"],
                        "kv_tokens_per_gib": kv_per_gib,
                        "weight_gb": weight_gb,
                        "start_s": start_s,
                        **r,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
            del llm, ex  # the executor holds the model and the KV pool
            gc.collect()
            torch.cuda.empty_cache()
        if not args.skip_hf:
            for b in args.batches:
                r = run_hf(hf, _prompts(b, args.prompt_len, tok, b), args.output_len)
                rows.append({"model": shape, "params": nparams, "system": "transformers static", "batch": b, **r})
                print(json.dumps(rows[-1]), flush=True)
        del hf
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| model | system | batch | output tok/s | mean TTFT (ms) | weights GB | KV tokens per GiB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['params'] / 1e6:.0f}M) | {r['system']} | {r['batch']} | "
            f"{r['tok_s']:,.0f} | {r['ttft_ms']:,.1f} | {r.get('weight_gb', 0):.2f} | {r.get('kv_tokens_per_gib', 0):,} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-1b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32, 256])
    ap.add_argument(
        "--backends",
        nargs="+",
        default=["triton_paged", "triton_paged:eager"],
        help="engine configurations: backend[:eager] (eager: no CUDA graphs)",
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument(
        "--gpu-memory-utilization", type=float, default=0.5, help="engine share (transformers' model stays loaded)"
    )
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--overlap-text",
        choices=["auto", "on", "off"],
        default="auto",
        help="the engine's overlap_text (auto: on CUDA)",
    )
    ap.add_argument("--model-dir", default=None, help="build the random models here once and reuse them")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = [r for m in args.models for r in bench_model(m, args)]
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
