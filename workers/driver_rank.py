"""Rank 0, run inside the driver process (as vLLM's driver worker): at pp=1 no Ray hop between
the scheduler and the rank that samples; at pp>1 the first stage's first rank. It owns its own
process group objects, bound to the calling thread only while it loads or steps, so several
engines (groups) can live in one process and be stepped from any thread.
"""

from __future__ import annotations

import gc
import traceback
from typing import TYPE_CHECKING

import torch

from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.distributed import TPGroup, bound_tp_group
from workers.rank_runner import RankRunner

if TYPE_CHECKING:
    from engine.config import CacheConfig
    from engine.model_config import ModelConfig
    from engine.runner.model_runner import ModelRunner


class DriverRank(RankRunner):
    def __init__(
        self,
        world_size: int,
        device: str | torch.device,
        num_threads: int,
        tp: int | None = None,
        layers: range | None = None,
    ) -> None:
        self.world_size = world_size
        self.tp_size = tp or world_size  # ranks per pipeline stage
        self.layers = layers  # the first stage's decoder layers (pp > 1)
        self.device = torch.device(device)
        self.num_threads = num_threads  # the engine's configured torch threads
        self.tp: TPGroup | None = None
        self.runner = None
        self._store = None
        self.rendezvous: tuple[str, int] | None = None

    # ---- set-up ----
    def open_rendezvous(self) -> tuple[str, int]:
        from workers.process_group import open_rendezvous

        addr, port, self._store = open_rendezvous(self.world_size)
        self.rendezvous = (addr, port)
        return addr, port

    def join(self) -> None:
        """Blocks until every remote rank has joined too (they are started just before)."""
        pp = self.world_size // self.tp_size
        self._join(0, self.tp_size, pp, self.layers, *self.rendezvous, store=self._store)

    def load(self, model_config: ModelConfig, cache_config: CacheConfig) -> int:
        with bound_tp_group(self.tp, self.pp):
            return self._build_runner(model_config, cache_config)

    # ---- per step ----
    def execute(self, so: SchedulerOutput, prev_sampled: dict[str, list[int]] | None = None) -> ModelRunnerOutput:
        """`prev_sampled`: at pp > 1 the last stage samples, and its tokens come back here."""
        if torch.get_num_threads() != self.num_threads:  # the engine may step us from its own thread
            torch.set_num_threads(self.num_threads)
        if prev_sampled:
            self._apply_prev_sampled(prev_sampled)
        with bound_tp_group(self.tp, self.pp):
            return self.runner.execute_model(so)

    def warm_up(self, max_tokens: int, max_logit_rows: int) -> None:
        with bound_tp_group(self.tp, self.pp):
            self.runner.warm_up(max_tokens, max_logit_rows)

    def measure_step_costs(self, max_batch: int, max_k: int) -> dict[tuple[int, int], float]:
        with bound_tp_group(self.tp, self.pp):
            return self.runner.measure_step_costs(max_batch, max_k)

    def leave(self, exc: BaseException | None = None) -> None:
        """Close our end of the group (remote ranks blocked with us fail instead of waiting)."""
        if exc is not None:  # its frames would keep the group (and its sockets) alive
            traceback.clear_frames(exc.__traceback__)
        self._abort_groups()
        if self.runner is not None:
            self.runner.close_offload()
        self.tp = self.pp = self.runner = self._store = None
        gc.collect()

    def info(self) -> dict:
        import os

        import ray

        ctx = ray.get_runtime_context()
        return {
            "rank": 0,
            "stage": 0,
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "placement_group_id": ctx.get_placement_group_id(),
            "rendezvous": self.rendezvous,
            **runner_info(self.runner, self.device, self.num_threads),
        }


def runner_info(runner: ModelRunner | None, device: torch.device | str, num_threads: int | None = None) -> dict:
    """What tests check about a rank's shard: parameter bytes, KV heads and cache shape."""
    from engine.model.loader import parameter_bytes

    loaded = runner is not None and runner.model is not None
    kv = runner.kv_caches if runner is not None else []
    return {
        "param_bytes": parameter_bytes(runner.model) if loaded else 0,
        "kv_cache_shape": tuple(kv[0].shape) if kv else None,
        "num_kv_heads": runner.num_kv_heads_local if loaded else None,
        "num_threads": num_threads or torch.get_num_threads(),
        "device": str(device),
    }
