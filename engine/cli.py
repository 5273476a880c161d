"""`python -m engine` / `orbital-generate`: run prompts through the offline engine from a shell.

`python -m workers` is the same command built with the Ray executor factory (`--tp` or `--pp` > 1)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from engine import choices
from engine.engine_args import EngineArgs
from engine.kv_offload.flags import add_offload_flags
from engine.layers.quant.spec import METHODS
from engine.lora.config import add_lora_flags

if TYPE_CHECKING:
    from engine.runner.executor import ExecutorFactory
    from engine.structured.spec import StructuredOutput


def parse_args(argv: Sequence[str] | None = None, prog: str = "python -m engine") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description="Generate text with Orbital's engine (offline).")
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", action="append", help="prompt (repeatable); read from stdin lines when absent")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--dtype", default=EngineArgs.dtype, choices=list(choices.DTYPES))
    p.add_argument(
        "--quantization",
        default=EngineArgs.quantization,
        choices=list(METHODS),
        help="weight-only: int8, int4[:g32|g64|g128] quantized at load, gguf (a GGUF's own blocks, K-quants included), gptq or awq (the checkpoint's own; taken from its quantization_config when unset)",
    )
    p.add_argument(
        "--int8-activations",
        action="store_true",
        default=EngineArgs.int8_activations,
        help="CPU, with quantization: activations rounded to int8 per group for integer dot products (llama.cpp's arithmetic; AVX-512 VNNI)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=EngineArgs.kv_cache_dtype,
        choices=list(choices.KV_CACHE_DTYPES),
        help="KV cache storage",
    )
    p.add_argument("--embed", action="store_true", help="print each prompt's embedding instead of generating")
    p.add_argument(
        "--pooling-type",
        default=EngineArgs.pooling_type,
        choices=list(choices.POOLING_TYPES),
        help="--embed: the last prompt token's final hidden state, or the mean over the prompt",
    )
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=EngineArgs.tensor_parallel_size)
    p.add_argument(
        "--pipeline-parallel-size",
        "--pp",
        type=int,
        default=EngineArgs.pipeline_parallel_size,
        help="pipeline stages: the model's layers in contiguous stages of --tp ranks each",
    )
    p.add_argument(
        "--pipeline-partition",
        default=EngineArgs.pipeline_partition,
        metavar="N,N,...",
        help="layers per stage, e.g. 14,16 (default: as even as the layer count allows)",
    )
    p.add_argument("--device", default=EngineArgs.device, help="cpu or cuda")
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=EngineArgs.kv_cache_memory_bytes,
        help="KV pool size (default: 1 GiB on CPU; on CUDA sized by --gpu-memory-utilization)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=EngineArgs.gpu_memory_utilization)
    add_offload_flags(p, lambda field: getattr(EngineArgs, field))
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    p.add_argument("--max-num-seqs", type=int, default=EngineArgs.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineArgs.max_num_batched_tokens)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--threads", type=int, default=EngineArgs.num_threads, help="torch threads (default: all cores)")
    add_lora_flags(p, lambda field: getattr(EngineArgs, field))
    p.add_argument("--lora", default=None, help="run the prompts with this LoRA adapter (a --lora-modules name)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    held = p.add_mutually_exclusive_group()  # structured outputs (engine/structured/)
    held.add_argument("--json-schema", default=None, help="the output matches this JSON schema (text or @file)")
    held.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    held.add_argument("--regex", default=None, help="the output matches this regular expression")
    held.add_argument("--choice", action="append", default=None, help="the output is one of these (repeatable)")
    held.add_argument("--grammar", default=None, help="the output matches this Lark or GBNF grammar (text or @file)")
    return p.parse_args(argv)


def _structured(args: argparse.Namespace) -> StructuredOutput | None:
    from engine.structured.spec import StructuredOutput

    def text(v: str) -> str:
        return Path(v[1:]).read_text() if v.startswith("@") else v

    if args.json_schema is not None:
        return StructuredOutput("json", text(args.json_schema), param="--json-schema")
    if args.json_object:
        return StructuredOutput("json_object", param="--json-object")
    if args.regex is not None:
        return StructuredOutput("regex", args.regex, param="--regex")
    if args.choice:
        return StructuredOutput("choice", args.choice, param="--choice")
    if args.grammar is not None:
        return StructuredOutput("grammar", text(args.grammar), param="--grammar")
    return None


def main(
    argv: Sequence[str] | None = None, executor_factory: ExecutorFactory | None = None, prog: str = "python -m engine"
) -> int:
    """`executor_factory`: who builds this engine picks its executor (ARCHITECTURE.md, rule 5)."""
    args = parse_args(argv, prog)
    from engine import LLM, InvalidRequestError, OrbitalError, SamplingParams
    from engine.runner.executor import in_process_executor

    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    try:
        params = SamplingParams(
            n=args.n,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            max_tokens=args.max_tokens,
            stop=args.stop,
            structured_output=_structured(args),
        )
        llm = LLM(
            args.model,
            executor_factory=executor_factory or in_process_executor,
            dtype=args.dtype,
            quantization=args.quantization,
            int8_activations=args.int8_activations,
            kv_cache_dtype=args.kv_cache_dtype,
            device=args.device,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            pipeline_partition=args.pipeline_partition,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_offload_bytes=args.kv_offload_bytes,
            kv_offload_medium=args.kv_offload_medium,
            kv_offload_dir=args.kv_offload_dir,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            num_threads=args.threads,
            enforce_eager=args.enforce_eager,
            pooling_type=args.pooling_type,
            enable_lora=args.enable_lora,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.max_cpu_loras,
            lora_modules=args.lora_modules,
        )
        if args.embed:
            for prompt, e in zip(prompts, llm.embed(prompts)):
                print(json.dumps({"prompt": prompt, "num_tokens": len(e.prompt_token_ids), "embedding": e.embedding}))
            return 0
        if args.chat:
            if args.lora:
                raise InvalidRequestError("--lora: not with --chat")
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outs = llm.generate(prompts, params, lora_request=args.lora)
    except (OrbitalError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": prompt,
                            "index": c.index,
                            "text": c.text,
                            "finish_reason": c.finish_reason,
                            "num_tokens": len(c.token_ids),
                        }
                    )
                )
            else:
                print(f"--- {prompt!r} [{c.index}] ({c.finish_reason}, {len(c.token_ids)} tokens)\n{prompt}{c.text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
