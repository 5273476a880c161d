"""One remote rank (1..world-1): a Ray actor that holds a model shard (its stage's layers, its
tp share of them), its KV cache shard and its own per-request state (engine.ModelRunner), and
runs one step per driver message. Rank 0 runs in the driver itself (workers/driver_rank.py).

The driver sends a `StepInput` per step: the scheduler's delta plus the token ids sampled last
step (ranks that do not sample learn them so). The sampling rank (rank 0 of the last stage at
pp > 1) returns the step's ModelRunnerOutput; the others return None.
"""

from __future__ import annotations

import gc
import os
import pickle
import traceback
from typing import TYPE_CHECKING

import torch

from engine.core.scheduler_output import ModelRunnerOutput
from workers.messages import StepInput
from workers.rank_runner import RankRunner

if TYPE_CHECKING:
    from engine.config import CacheConfig
    from engine.model_config import ModelConfig


def sampled_delta(out: ModelRunnerOutput | None) -> dict[str, list[int]]:
    if out is None:
        return {}
    return {r: t for r, t in zip(out.request_ids, out.sampled_token_ids) if t}


class TPWorker(RankRunner):
    """Wrapped with ray.remote by the executor (this module itself does not need ray)."""

    def __init__(
        self, rank: int, world_size: int, device: str = "cpu", num_threads: int = 1, tp: int | None = None
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.tp_size = tp or world_size  # ranks per pipeline stage
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)  # Ray sets CUDA_VISIBLE_DEVICES to our GPU
        self.num_threads = num_threads
        torch.set_num_threads(num_threads)
        self.runner = None
        self.tp = None
        self._broken: str | None = None
        self._rendezvous: tuple[str, int] | None = None

    # ---- set-up, called once in this order ----
    def join(self, addr: str, port: int, layers: range | None = None) -> None:
        """`layers`: this rank's stage's decoder layers (pp > 1)."""
        from engine.distributed import set_tp_group

        self._rendezvous = (addr, port)
        self._join(self.rank, self.tp_size, self.world_size // self.tp_size, layers, addr, port)
        set_tp_group(self.tp.size, self.tp.rank, self.tp.group, self.pp)

    def load(self, model_config: ModelConfig, cache_config: CacheConfig) -> int:
        return self._build_runner(model_config, cache_config)

    # ---- per step ----
    def execute(self, payload: bytes) -> ModelRunnerOutput | None:
        """One step: `payload` is a pickled StepInput (pickled once by the driver for all ranks)."""
        if self._broken:
            raise RuntimeError(f"tensor-parallel rank {self.rank} is unusable after an earlier error: {self._broken}")
        if torch.get_num_threads() != self.num_threads:  # in case Ray runs us on another thread
            torch.set_num_threads(self.num_threads)
        try:
            inp: StepInput = pickle.loads(payload)
            self._apply_prev_sampled(inp.prev_sampled)
            return self.runner.execute_model(inp.so)
        except BaseException as e:
            self._broken = f"{type(e).__name__}: {e}"
            self._leave(e)
            raise RuntimeError(f"tensor-parallel rank {self.rank} failed: {self._broken}") from e

    def _leave(self, exc: BaseException | None = None) -> None:
        """Drop every reference to the group so its connections close and rank 0, blocked in a
        collective with us, fails now rather than at the collective timeout. The traceback's
        frames would keep the group alive, so their locals are cleared first."""
        from engine.distributed import set_tp_group

        if exc is not None:
            traceback.clear_frames(exc.__traceback__)
        self._abort_groups()
        if self.runner is not None:
            self.runner.close_offload()
        set_tp_group(1, 0, None)
        self.runner = self.tp = self.pp = None
        gc.collect()

    # ---- health and introspection ----
    def ping(self) -> int:
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    def info(self) -> dict:
        import ray

        from workers.driver_rank import runner_info

        ctx = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "stage": self.rank // self.tp_size,
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "placement_group_id": ctx.get_placement_group_id(),
            "rendezvous": self._rendezvous,
            **runner_info(self.runner, self.device),
        }

    def close_offload(self) -> None:
        """Remove this rank's offload tier file (the executor calls it before killing us)."""
        if self.runner is not None:
            self.runner.close_offload()

    def shutdown(self) -> None:
        self._leave()
