"""The executor for tensor_parallel_size > 1: rank 0 runs in the driver process (the engine's
own), ranks 1..tp-1 are Ray actors in a STRICT_PACK placement group on the driver's node; one
torch.distributed group, one model copy and one KV cache between them.

Per step the driver submits the scheduler's delta (plus the token ids rank 0 sampled last
step) to the remote ranks without waiting, runs rank 0 itself (which samples), and only reaps
remote calls that have already finished. A dead or failed rank becomes an EngineDeadError
naming it: it breaks rank 0's collective (closed connection) or shows in a reaped call; the
group is then torn down so nothing waits on it, and a new executor can be built in its place.
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING

import ray
import torch

from engine.config import CacheConfig, ParallelConfig
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.errors import EngineDeadError
from engine.kv_transfer.block_io import head_slice
from engine.kv_transfer.blocks import KVLayout
from engine.model_config import ModelConfig
from engine.runner.executor import Executor
from workers.driver_rank import DriverRank
from workers.messages import StepInput
from workers.placement import ensure_ray, place_group, rank_resources, release_ray
from workers.remote_ranks import RemoteRanks
from workers.sharding import check_tp_compatible
from workers.worker import TPWorker, sampled_delta

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

logger = logging.getLogger(__name__)


class RayExecutor(Executor):
    """`placement_group`/`bundle_indices`: run the remote ranks in the caller's placement group
    (a Serve replica's: bundle 0 is the replica's own, for rank 0); by default the current
    placement group is used when there is one, else a new one on the driver's node. Rank 0 uses
    the driver's torch thread count; remote ranks `max(1, num_cpus_per_worker)` threads each.
    The KV budget (`kv_cache_memory_bytes`) is per rank."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        parallel: ParallelConfig,
        device: str | torch.device = "cpu",
        *,
        placement_group: PlacementGroup | None = None,
        bundle_indices: list[int] | None = None,
        num_cpus_per_worker: float = 1.0,
        step_timeout_s: float | None = None,
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.tp = tp = parallel.tensor_parallel_size
        check_tp_compatible(model_config.hf_config, tp)
        self.device = torch.device(device)
        self.step_timeout_s = step_timeout_s or float(os.environ.get("ORBITAL_STEP_TIMEOUT_S", "600"))
        self.rank0: DriverRank | None = None
        self.remote: RemoteRanks | None = None
        self.placement = None
        self._dead: str | None = None
        self._prev: dict[str, list[int]] = {}
        self._started_ray = ensure_ray(math.ceil(tp * num_cpus_per_worker))
        try:
            self.placement = place_group(tp, self.device.type, num_cpus_per_worker, placement_group, bundle_indices)
            # Health checks and introspection run in their own thread ("control"), so they answer
            # while a step is running; steps stay in the default group: one at a time, in order.
            actor_cls = ray.remote(concurrency_groups={"control": 1})(TPWorker)
            gpus = rank_resources(self.device.type, num_cpus_per_worker).get("GPU", 0)
            threads = max(1, int(num_cpus_per_worker))
            self.remote = RemoteRanks(
                [
                    actor_cls.options(
                        num_cpus=num_cpus_per_worker,
                        num_gpus=gpus,
                        max_restarts=0,
                        scheduling_strategy=self.placement.strategy(r - 1),
                    ).remote(r, tp, str(self.device), threads)
                    for r in range(1, tp)
                ]
            )
            self.rank0 = DriverRank(tp, self.placement.driver_device or self.device, torch.get_num_threads())
            t = startup_timeout_s
            ray.get([w.ping.remote() for w in self.workers], timeout=t)  # started: the join window stays short
            addr, port = self.rank0.open_rendezvous()
            joins = [w.join.remote(addr, port) for w in self.workers]
            self.rank0.join()
            ray.get(joins, timeout=t)
            loads = [w.load.remote(model_config, cache_config) for w in self.workers]
            budget0 = self.rank0.load(model_config, cache_config)  # loads alongside the remote ranks
            self.num_blocks = min([budget0] + ray.get(loads, timeout=t))
            inits = [w.init_kv_cache.remote(self.num_blocks) for w in self.workers]
            self._bytes_per_block = self.rank0.init_kv_cache(self.num_blocks)
            ray.get(inits, timeout=t)
            self.num_offload_slots = self.rank0.runner.offload_slots()  # each rank's store has these
        except BaseException:
            self.shutdown()
            raise

    @property
    def workers(self) -> list:
        """The remote ranks' actors: workers[i] is rank i + 1."""
        return self.remote.actors if self.remote else []

    # ---- the Executor interface ----
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self._dead:
            raise EngineDeadError(self._dead)
        try:
            self.remote.submit(StepInput(so, self._prev))
            out = self.rank0.execute(so)
            self.remote.reap(self.step_timeout_s)
        except Exception as e:
            self._fail(e)
        self._prev = sampled_delta(out)
        return out

    def check_health(self) -> None:
        if self._dead:
            raise EngineDeadError(self._dead)
        refs = [w.ping.options(concurrency_group="control").remote() for w in self.workers]
        try:
            ray.get(refs, timeout=10)
        except ray.exceptions.GetTimeoutError:
            # Slow, not gone: unhealthy for now (Serve replaces the replica if it stays so); a
            # group torn down on one late answer lost every request in it.
            raise EngineDeadError("a tensor-parallel rank did not answer its health ping within 10 s") from None
        except Exception as e:
            self._fail(e)

    def kv_bytes_per_block(self) -> int:
        return self._bytes_per_block

    def kv_layout(self) -> KVLayout:
        return self.rank0.runner.kv_layout()

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Every rank's heads of these blocks, gathered here (dim 2 is the KV heads, in rank
        order). Remote ranks' calls queue behind the steps already sent to them."""
        refs = [w.read_kv_blocks.remote(block_ids) for w in self.workers]
        try:
            parts = [self.rank0.read_kv_blocks(block_ids)] + ray.get(refs, timeout=self.step_timeout_s)
        except Exception as e:
            self._fail(e)
        return torch.cat(parts, dim=2)

    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Each rank gets only its slice of the heads (prefill and decode TP may differ)."""
        refs = [
            w.write_kv_blocks.remote(block_ids, head_slice(data, r, self.tp)) for r, w in enumerate(self.workers, 1)
        ]
        try:
            self.rank0.write_kv_blocks(block_ids, head_slice(data, 0, self.tp))
            ray.get(refs, timeout=self.step_timeout_s)
        except Exception as e:
            self._fail(e)

    def measure_step_costs(self, max_batch: int, max_k: int) -> dict[tuple[int, int], float] | None:
        """The speculative verify-step cost table, measured by all ranks together (before any
        request: nothing else is in flight on the group)."""
        refs = [w.measure_step_costs.remote(max_batch, max_k) for w in self.workers]
        try:
            table = self.rank0.measure_step_costs(max_batch, max_k)
            ray.get(refs, timeout=self.step_timeout_s)
        except Exception as e:
            self._fail(e)
        return table

    def shutdown(self) -> None:
        if self.remote is not None and self.num_offload_slots and not self._dead:
            # Their offload files go with them; on the control thread, in case a step hangs.
            refs = [w.close_offload.options(concurrency_group="control").remote() for w in self.workers]
            try:
                ray.get(refs, timeout=10)
            except Exception as e:
                logger.warning("a rank did not remove its offload tier file: %s", e)
        if self.remote is not None:
            self.remote.kill()  # first: a remote rank may be blocked in a collective with rank 0
            self.remote = None
        if self.rank0 is not None:
            self.rank0.leave()
            self.rank0 = None
        if self.placement is not None:
            self.placement.release()
            self.placement = None
        if self._started_ray:
            self._started_ray = False
            release_ray()

    # ---- introspection (tests, benchmarks) ----
    def worker_info(self) -> list[dict]:
        """Every rank, rank 0 (this process) first."""
        remote = ray.get([w.info.options(concurrency_group="control").remote() for w in self.workers], timeout=30)
        return [self.rank0.info()] + remote

    # ---- failure handling ----
    def _fail(self, cause: BaseException):
        self._dead = self._diagnose(cause)
        logger.error("tensor-parallel group failed: %s", self._dead)
        # Rank 0 lets go of the group only now: had it closed first, a rank still blocked in a
        # collective with it would fail too and look like the culprit.
        if self.remote is not None:
            self.remote.kill()
        if self.rank0 is not None:
            self.rank0.leave(cause)
        raise EngineDeadError(self._dead) from cause

    def _diagnose(self, cause: BaseException) -> str:
        """Name the rank(s) that died or failed first; rank 0 when the remote ranks are fine."""
        dead, failed = self.remote.failures(wait_s=3.0) if self.remote else ([], {})
        if dead:
            ranks = ", ".join(map(str, dead))
            return (
                f"tensor-parallel rank {ranks} of {self.tp} died (worker actor gone); "
                f"the engine cannot continue (first error seen: {_summary(cause)})"
            )
        if failed:
            # A rank that lost its peer fails too: prefer the one whose error is its own.
            own = [r for r, e in failed.items() if not _lost_peer(e)] or sorted(failed)
            rank = min(own)
            return f"tensor-parallel rank {rank} of {self.tp} failed: {_summary(failed[rank])}"
        return f"tensor-parallel rank 0 of {self.tp} (in the driver) failed: {_summary(cause)}"


def _lost_peer(err: BaseException) -> bool:
    text = str(err)
    return "Connection closed by peer" in text or "Connection reset by peer" in text


def _summary(cause: BaseException) -> str:
    """One readable line: the remote exception rather than Ray's wrapper, plus the death reason."""
    inner = cause
    while isinstance(inner, ray.exceptions.RayTaskError) and getattr(inner, "cause", None) is not None:
        inner = inner.cause
    lines = [ln.strip() for ln in str(inner).strip().splitlines() if ln.strip()]
    if not lines:
        return type(inner).__name__
    text = lines[0] if len(lines) == 1 or lines[-1] == lines[0] else f"{lines[0]} {lines[-1]}"
    return f"{type(inner).__name__}: {text}"[:400]
