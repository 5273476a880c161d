"""The executor interface the engine calls once per step, and the in-process one (tp=1).

The engine never chooses a multi-process executor itself: whoever builds the engine passes an
`ExecutorFactory` (the Ray one for tp>1 is `workers.make_executor`), as Ray Serve LLM injects
its engine class. The default factory runs tp=1 in this process and refuses tp>1.
"""

from __future__ import annotations

import abc
import os
from typing import Callable

import torch

from engine.config import CacheConfig, ParallelConfig
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.errors import InvalidRequestError
from engine.kv_transfer.blocks import KVLayout
from engine.model_config import ModelConfig


class Executor(abc.ABC):
    num_blocks: int
    num_offload_slots: int = 0  # blocks the offload tier holds (engine/kv_offload/); 0: off
    # Steps that may be launched before the oldest completes (a pipeline's stages, each busy
    # with its own micro-batch); 1: a step completes before the next is launched.
    max_concurrent_batches: int = 1

    @abc.abstractmethod
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput: ...

    def launch_model(self, so: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Start the step; the returned call completes it (model_runner.launch_model). Here the
        step runs to the end at once."""
        mro = self.execute_model(so)
        return lambda: mro

    def check_health(self) -> None:
        """Raise EngineDeadError when a worker is gone."""

    def rank_pids(self) -> list[int]:
        """The process of each rank, rank 0 first (operators: which processes serve a replica)."""
        return [os.getpid()]

    def shutdown(self) -> None:
        pass

    def kv_bytes_per_block(self) -> int:
        return 0

    @abc.abstractmethod
    def kv_layout(self) -> KVLayout:
        """The KV cache's layout over all ranks (what a KV hand-off must match)."""

    @abc.abstractmethod
    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Contents of these blocks, every KV head (kv_transfer.KVBlocks.data layout), on the CPU."""

    @abc.abstractmethod
    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write every-head contents (as `read_kv_blocks` returns them) into these blocks."""

    def warm_up(self, max_tokens: int, max_logit_rows: int) -> None:
        """Build every linear kernel a step can need before the first request (runner/warm_up.py)."""

    def measure_step_costs(self, max_batch: int, max_k: int) -> dict[tuple[int, int], float] | None:
        """Seconds of a step of B rows computing 1 + k tokens each (the speculative verify cost
        model); None: not measured, the engine assumes cost proportional to tokens."""
        return None


class InProcessExecutor(Executor):
    """tp=1: the model runner lives in this process; no Ray hop per step."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: str | torch.device = "cpu",
        cuda_graph_max_batch: int = 0,
    ) -> None:
        from engine.runner.model_runner import ModelRunner

        self.runner = ModelRunner(model_config, cache_config, device, cuda_graph_max_batch)
        self.runner.load_model()
        self.num_blocks = self.runner.num_blocks_for_budget()
        self.runner.init_kv_cache(self.num_blocks)
        self.num_offload_slots = self.runner.offload_slots()
        self.runner.capture_cuda_graphs()

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(so)

    def launch_model(self, so: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        return self.runner.launch_model(so)

    def kv_bytes_per_block(self) -> int:
        return self.runner.bytes_per_block()

    def shutdown(self) -> None:
        self.runner.close_offload()

    def kv_layout(self) -> KVLayout:
        return self.runner.kv_layout()

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.runner.read_kv_blocks(block_ids)

    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.runner.write_kv_blocks(block_ids, data)

    def warm_up(self, max_tokens: int, max_logit_rows: int) -> None:
        self.runner.warm_up(max_tokens, max_logit_rows)

    def measure_step_costs(self, max_batch: int, max_k: int) -> dict[tuple[int, int], float] | None:
        return self.runner.measure_step_costs(max_batch, max_k)


# (model config, cache config, parallel config, device, CUDA-graph batch bound) -> executor
ExecutorFactory = Callable[[ModelConfig, CacheConfig, ParallelConfig, "str | torch.device", int], Executor]


def in_process_executor(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    parallel: ParallelConfig,
    device: str | torch.device = "cpu",
    cuda_graph_max_batch: int = 0,
) -> Executor:
    """The default ExecutorFactory: tp=1 only."""
    if parallel.world_size != 1:
        raise InvalidRequestError(
            f"tensor_parallel_size={parallel.tensor_parallel_size} x pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size} needs an executor that spans processes: "
            "build the engine with workers.make_executor (or use workers.LLM offline)"
        )
    return InProcessExecutor(model_config, cache_config, device, cuda_graph_max_batch)
