"""The ExecutorFactory of processes that may run tensor-parallel groups (Serve replicas,
`workers.LLM`): in-process at tp=1, Ray actors for ranks 1..tp-1 at tp>1."""

from __future__ import annotations

import torch

from engine.config import CacheConfig, ParallelConfig
from engine.model_config import ModelConfig
from engine.runner.executor import Executor, in_process_executor


def make_executor(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    parallel: ParallelConfig,
    device: str | torch.device = "cpu",
    cuda_graph_max_batch: int = 0,
) -> Executor:
    if parallel.world_size == 1:
        return in_process_executor(model_config, cache_config, parallel, device, cuda_graph_max_batch)
    from workers.ray_executor import RayExecutor  # imports ray: only where a group is built

    return RayExecutor(model_config, cache_config, parallel, device)
