"""Multi-LoRA throughput: one batch spread over 1, 4 and 16 adapters against the base model alone
(an engine without LoRA), and the time to first token of a request whose adapter is not loaded.

Random rank-r adapters on every attention and MLP linear of the model are written in PEFT's
format (no training; their values do not change the work). Greedy, ignore_eos, one batch of
--batch requests of --prompt-len tokens and --max-tokens outputs, timed after a warm-up run.

    python -m bench.bench_lora                  # SmolLM2-135M, float32, rank 16, batch 16
    python -m bench.bench_lora --adapters 1 4 16 --rank 8 --threads 2
    python -m bench.bench_lora --shape llama-1b --dtype bfloat16     # a random Llama (bench/random_llama.py)

At one row per adapter a step reads every adapter's weights once, beside the base weights the
rows share; the run prints both.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.lora.adapter import module_shapes
from engine.lora.config import TARGET_MODULES


def write_adapter(path: Path, hf_config, rank: int, seed: int) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for module, (fin, fout) in module_shapes(hf_config).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fin, generator=g) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES)}
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def weight_bytes(hf_config, rank: int, element_size: int) -> tuple[int, int]:
    """Bytes of the weights a decode step reads (the layers' linears and the LM head), and of one
    rank-`rank` adapter on every targeted linear."""
    shapes = module_shapes(hf_config)
    layers = hf_config.num_hidden_layers
    base = layers * sum(fin * fout for fin, fout in shapes.values()) + hf_config.vocab_size * hf_config.hidden_size
    adapter = layers * sum(rank * (fin + fout) for fin, fout in shapes.values())
    return base * element_size, adapter * element_size


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras: list) -> float:
    """Output tokens/s of one batch (after a warm-up run of the same batch)."""
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--shape", default=None, help="a random Llama of this bench/random_llama.py shape")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    tmp_model = None
    if a.shape:
        from bench.random_llama import save_random_llama

        tmp_model = tempfile.TemporaryDirectory()
        save_random_llama(tmp_model.name, a.shape, getattr(torch, a.dtype), device="cpu")
        a.model = tmp_model.name
    common = dict(dtype=a.dtype, num_threads=a.threads, kv_cache_memory_bytes=256 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    base = LLM(a.model, **common)
    hf_config = base.engine.model_config.hf_config
    vocab = hf_config.vocab_size
    prompts = [[(7919 * (i * a.prompt_len + j)) % vocab for j in range(a.prompt_len)] for i in range(a.batch)]
    results = {"base": run(base, prompts, params, None)}
    print(f"base: {results['base']:.1f} tok/s", flush=True)
    base.shutdown()
    del base
    most = max(a.adapters)
    with tempfile.TemporaryDirectory() as tmp:
        loras = []
        for i in range(most):
            write_adapter(Path(tmp) / f"a{i}", hf_config, a.rank, seed=i)
            loras.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        llm = LLM(a.model, enable_lora=True, max_loras=most, max_lora_rank=a.rank, **common)
        results["base, LoRA on"] = run(llm, prompts, params, None)
        for n in a.adapters:
            results[f"{n} adapters"] = run(llm, prompts, params, [loras[i % n] for i in range(a.batch)])
            print(f"{n} adapters: {results[f'{n} adapters']:.1f} tok/s", flush=True)
        llm.shutdown()
        # Time to first token: an adapter in its slot, and one read from disk into the slot.
        one = LLM(a.model, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=a.rank, **common)
        first = SamplingParams(temperature=0.0, max_tokens=1)
        ttft = {}
        for label, lora in (("warm", loras[0]), ("warm", loras[0]), ("cold", loras[-1] if most > 1 else loras[0])):
            t0 = time.perf_counter()
            one.generate([{"prompt_token_ids": prompts[0]}], first, use_tqdm=False, lora_request=lora)
            ttft[label] = time.perf_counter() - t0
        one.shutdown()
    ref = results["base"]
    for k, v in results.items():
        print(f"{k:>16}: {v:7.1f} tok/s  {v / ref:.2f}x base")
    print(f"TTFT, adapter in its slot: {ttft['warm'] * 1e3:.0f} ms; read from disk: {ttft['cold'] * 1e3:.0f} ms")
    base_bytes, adapter_bytes = weight_bytes(hf_config, a.rank, getattr(torch, a.dtype).itemsize)
    print(
        f"bytes a decode step reads: base {base_bytes / 1e6:.0f} MB, each adapter {adapter_bytes / 1e6:.1f} MB "
        f"(as {a.dtype}): {most} adapters add {most * adapter_bytes / base_bytes:.0%} to the base's"
    )


if __name__ == "__main__":
    main()
