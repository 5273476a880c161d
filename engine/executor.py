"""The executor interface the engine calls once per step, and the in-process one (tp=1).

The Ray executor for tp>1 lives in workers/ (the engine never imports ray) and is chosen by
`make_executor` through an import only when tensor_parallel_size > 1.
"""
from __future__ import annotations

import abc

import torch

from engine.config import CacheConfig, ParallelConfig
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.model_config import ModelConfig


class Executor(abc.ABC):
    num_blocks: int

    @abc.abstractmethod
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput: ...

    def check_health(self) -> None:
        """Raise EngineDeadError when a worker is gone."""

    def shutdown(self) -> None:
        pass

    def kv_bytes_per_block(self) -> int:
        return 0


class InProcessExecutor(Executor):
    """tp=1: the model runner lives in this process; no Ray hop per step."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, device: str | torch.device = "cpu",
                 cuda_graph_max_batch: int = 0):
        from engine.model_runner import ModelRunner

        self.runner = ModelRunner(model_config, cache_config, device, cuda_graph_max_batch)
        self.runner.load_model()
        self.num_blocks = self.runner.num_blocks_for_budget()
        self.runner.init_kv_cache(self.num_blocks)
        self.runner.capture_cuda_graphs()

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(so)

    def kv_bytes_per_block(self) -> int:
        return self.runner.bytes_per_block()


def make_executor(model_config: ModelConfig, cache_config: CacheConfig, parallel: ParallelConfig,
                  device: str | torch.device = "cpu", cuda_graph_max_batch: int = 0) -> Executor:
    if parallel.tensor_parallel_size == 1:
        return InProcessExecutor(model_config, cache_config, device, cuda_graph_max_batch)
    try:
        from workers.ray_executor import RayExecutor
    except ImportError as e:  # workers/ needs ray
        raise ImportError(f"tensor_parallel_size > 1 needs the Ray executor (workers/): {e}") from e
    return RayExecutor(model_config, cache_config, parallel, device)
