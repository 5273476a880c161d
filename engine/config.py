"""Engine configuration: frozen dataclasses checked at construction. Defaults shared with the
user-facing settings come from EngineArgs (one place for each default). No torch here: the
serving layer's config (router/config.py) imports it, and its router replicas do not load torch."""

from __future__ import annotations

from dataclasses import dataclass

from engine.choices import KV_CACHE_DTYPES, KV_OFFLOAD_MEDIA, SCHEDULING_POLICIES
from engine.engine_args import CPU_KV_CACHE_BYTES, EngineArgs
from engine.errors import InvalidRequestError


def check_kv_cache_dtype(name: str) -> str:
    if name not in KV_CACHE_DTYPES:
        raise InvalidRequestError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    return name


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = EngineArgs.block_size
    enable_prefix_caching: bool = EngineArgs.enable_prefix_caching
    kv_cache_memory_bytes: int = CPU_KV_CACHE_BYTES
    num_blocks: int | None = None  # set directly (tests) instead of the memory budget
    # CUDA: size the pool from what a profiled dummy step leaves of this share of the GPU's
    # memory (None: use kv_cache_memory_bytes). The dummy step has profile_num_tokens tokens.
    gpu_memory_utilization: float | None = None
    profile_num_tokens: int = EngineArgs.max_num_batched_tokens
    kv_cache_dtype: str = EngineArgs.kv_cache_dtype  # "auto" (the model's dtype), "int8" or "fp8_e4m3"
    # The offload tier (engine/kv_offload/): bytes per replica (0: off), its medium and directory.
    kv_offload_bytes: int = EngineArgs.kv_offload_bytes
    kv_offload_medium: str = EngineArgs.kv_offload_medium
    kv_offload_dir: str | None = EngineArgs.kv_offload_dir

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise InvalidRequestError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.kv_cache_memory_bytes <= 0:
            raise InvalidRequestError("kv_cache_memory_bytes must be > 0")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_offload_bytes < 0:
            raise InvalidRequestError(f"kv_offload_bytes must be >= 0, got {self.kv_offload_bytes}")
        if self.kv_offload_medium not in KV_OFFLOAD_MEDIA:
            raise InvalidRequestError(
                f"kv_offload_medium must be one of {KV_OFFLOAD_MEDIA}, got {self.kv_offload_medium!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = EngineArgs.max_num_seqs
    max_num_batched_tokens: int = EngineArgs.max_num_batched_tokens
    max_model_len: int = 8192
    policy: str = EngineArgs.scheduling_policy  # or "priority"
    long_prefill_token_threshold: int = 0  # 0: no cap per request per step

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise InvalidRequestError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise InvalidRequestError("max_num_batched_tokens must be >= 1")
        if self.policy not in SCHEDULING_POLICIES:
            raise InvalidRequestError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = EngineArgs.tensor_parallel_size
    pipeline_parallel_size: int = EngineArgs.pipeline_parallel_size
    pipeline_partition: tuple[int, ...] | None = None  # layers per stage (engine/pipeline.py)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise InvalidRequestError("tensor_parallel_size must be >= 1")
        if self.pipeline_parallel_size < 1:
            raise InvalidRequestError("pipeline_parallel_size must be >= 1")
        if self.pipeline_partition is not None and len(self.pipeline_partition) != self.pipeline_parallel_size:
            raise InvalidRequestError(
                f"pipeline_partition {list(self.pipeline_partition)} names {len(self.pipeline_partition)} stages, "
                f"pipeline_parallel_size is {self.pipeline_parallel_size}",
                param="pipeline_partition",
            )

    @property
    def world_size(self) -> int:
        """Ranks in one replica: a tensor-parallel group per pipeline stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
