"""EngineArgs: every engine setting a user makes, with its default, in one place.

A light module (dataclasses only, no torch) so the serving layer's config can take its
defaults from here instead of repeating them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineArgs:
    """Everything a user sets; `LLMEngine` turns it into the frozen inner configs."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None  # None: 1 GiB on CPU, gpu_memory_utilization on CUDA
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None
    tensor_parallel_size: int = 1
    # Pipeline parallelism (engine/pipeline.py): the layers split into this many contiguous
    # stages, each a tensor-parallel group, stages on different nodes where the cluster has them.
    pipeline_parallel_size: int = 1
    # Layers per stage, e.g. (14, 16) or "14,16"; None: as even as the layer count allows.
    pipeline_partition: tuple[int, ...] | str | None = None
    scheduling_policy: str = "fcfs"
    served_model_name: str | None = None
    num_threads: int | None = None
    # CPU: steps of at most this many tokens run on one thread fewer, leaving a core to the
    # processes that stream each token out (engine/step_threads.py); 0: never. The serving
    # layer turns it on; offline there is nobody to leave the core to.
    spare_core_max_tokens: int = 0
    enforce_eager: bool = False  # CUDA: no decode CUDA graphs (CPU never captures any)
    # Build every linear kernel a step can need before the first request (engine/runner/warm_up.py).
    warmup: bool = True
    # Turn the previous step's tokens into text while the device runs the next step (the step
    # is launched first). None: on where steps run asynchronously (CUDA, tp=1); on CPU a step
    # runs to its end when launched, so overlapping would only deliver text a step later.
    overlap_text: bool | None = None
    # Speculative decoding, off by default: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": .., "prompt_lookup_max": ..} or "ngram:k" (engine/spec_decode/config.py).
    speculative_config: dict | str | None = None
    # Weight-only quantization of the linear layers and the LM head: "int8" (per output channel)
    # or "int4" / "int4:g32|g64|g128" (group-wise) quantized at load, "gguf" (a GGUF model's own
    # blocks: Q8_0, Q4_*, Q5_*, Q2_K..Q6_K), "gptq" / "awq" (the checkpoint's own integers); None
    # keeps the checkpoint's float weights, or a GPTQ / AWQ checkpoint's (engine/layers/quant/).
    quantization: str | None = None
    # CPU, with quantization: 4-, 5- and 8-bit weights multiply activations rounded to int8 per
    # group with integer dot products (llama.cpp's arithmetic; AVX-512 VNNI, VBMI and BITALG):
    # faster batched steps, logits within that rounding of the bf16 path (engine/layers/quant/int4.py).
    int8_activations: bool = False
    # The KV cache's storage: "auto" (the model's dtype), "int8" or "fp8_e4m3" (per-token, per-head
    # scales, no calibration: engine/layers/attention/kv_quant.py), about 1.9x the tokens of bf16.
    kv_cache_dtype: str = "auto"
    # Disaggregated serving (engine/kv_transfer/config.py): {"role": "prefill" | "decode",
    # "local_prefill_max_tokens": n}; None: colocated (this engine prefills and decodes).
    kv_transfer_config: dict | None = None
    # Embedding requests (`LLM.embed`, /v1/embeddings): how the final-norm hidden states of the
    # prompt become one vector, L2-normalised: "last" (the last prompt token's) or "mean".
    pooling_type: str = "last"
    # Multi-LoRA serving (engine/lora/), vLLM's names: adapters in one batch, their largest rank,
    # adapters held in host memory (None: max_loras), and adapters known at start ("name=path"
    # strings or a dict name -> path).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[str, ...] | dict | None = None
    # The offload tier (engine/kv_offload/): KV blocks evicted from the pool are kept here, up to
    # this many bytes per replica (all ranks together), and loaded back on a prefix hit; 0: off.
    kv_offload_bytes: int = 0
    # "disk": one memory-mapped file per rank; "host": host memory (pinned on CUDA).
    kv_offload_medium: str = "disk"
    # Where the disk tier's files live; None: a temporary directory per engine, removed at shutdown.
    kv_offload_dir: str | None = None


CPU_KV_CACHE_BYTES = 1 << 30  # the KV budget on CPU when kv_cache_memory_bytes is None
