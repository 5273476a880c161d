"""The executor for tensor_parallel_size x pipeline_parallel_size > 1: rank 0 runs in the driver
process (the engine's own), ranks 1..world-1 are Ray actors (workers/placement.py: the first
stage on the driver's node, each later stage on a node of its own); one model copy and one KV
cache between them, each stage holding its layers' share (engine/pipeline.py).

Per step the driver submits the scheduler's delta (plus the token ids sampled last step) to
the remote ranks without waiting, runs rank 0 itself, and only reaps remote calls that have
already finished. At pp=1 rank 0 samples and the step ends with it. At pp>1 rank 0 runs the
first stage and hands its output on; the step ends when the last stage's rank 0, which
samples, returns its output. Meanwhile the engine may launch up to pp steps
(`max_concurrent_batches`), each stage busy with a different one. A dead or failed rank becomes an EngineDeadError
naming it: it breaks rank 0's collective (closed connection) or shows in a reaped call; the
group is then torn down so nothing waits on it, and a new executor can be built in its place.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from typing import TYPE_CHECKING, Callable

import ray
import torch

from engine.config import CacheConfig, ParallelConfig
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.errors import EngineDeadError
from engine.kv_transfer.block_io import head_slice
from engine.kv_transfer.blocks import KVLayout
from engine.model_config import ModelConfig
from engine.pipeline import stage_layer_ranges
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
        self.pp = pp = parallel.pipeline_parallel_size
        self.world = world = tp * pp
        check_tp_compatible(model_config.hf_config, tp)
        self.stage_layers = stage_layer_ranges(model_config.num_layers, pp, parallel.pipeline_partition)
        self.max_concurrent_batches = pp
        self.sampler = (pp - 1) * tp  # the rank that samples: rank 0 of the last stage
        # Micro-batch counters (tests, benchmarks): steps launched, in the pipe now, most at once.
        self.steps_launched = self.in_flight = self.max_in_flight = 0
        self.device = torch.device(device)
        self.step_timeout_s = step_timeout_s or float(os.environ.get("ORBITAL_STEP_TIMEOUT_S", "600"))
        self.rank0: DriverRank | None = None
        self.remote: RemoteRanks | None = None
        self.placement = None
        self._dead: str | None = None
        self._prev: dict[str, list[int]] = {}
        self._started_ray = ensure_ray(math.ceil(world * num_cpus_per_worker))
        try:
            self.placement = place_group(
                world, self.device.type, num_cpus_per_worker, placement_group, bundle_indices, tp=tp
            )
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
                    ).remote(r, world, str(self.device), threads, tp)
                    for r in range(1, world)
                ]
            )
            driver_device = self.placement.driver_device or self.device
            self.rank0 = DriverRank(world, driver_device, torch.get_num_threads(), tp, self.stage_layers[0])
            t = startup_timeout_s
            ray.get([w.ping.remote() for w in self.workers], timeout=t)  # started: the join window stays short
            addr, port = self.rank0.open_rendezvous()
            joins = [w.join.remote(addr, port, self.stage_layers[r // tp]) for r, w in enumerate(self.workers, 1)]
            self.rank0.join()
            ray.get(joins, timeout=t)
            loads = [w.load.remote(model_config, cache_config) for w in self.workers]
            budget0 = self.rank0.load(model_config, cache_config)  # loads alongside the remote ranks
            self.num_blocks = min([budget0] + ray.get(loads, timeout=t))
            inits = [w.init_kv_cache.remote(self.num_blocks) for w in self.workers]
            self._bytes_per_block = self.rank0.init_kv_cache(self.num_blocks)
            ray.get(inits, timeout=t)
            self.num_offload_slots = self.rank0.runner.offload_slots()  # each rank's store has these
            self._pids = [os.getpid()] + ray.get([w.pid.remote() for w in self.workers], timeout=t)
        except BaseException:
            self.shutdown()
            raise

    @property
    def workers(self) -> list:
        """The remote ranks' actors: workers[i] is rank i + 1."""
        return self.remote.actors if self.remote else []

    # ---- the Executor interface ----
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch_model(so)()

    def launch_model(self, so: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        if self._dead:
            raise EngineDeadError(self._dead)
        prev, self._prev = self._prev, {}
        try:
            refs = self.remote.submit(StepInput(so, prev), sampler=self.sampler if self.pp > 1 else None)
            out = self.rank0.execute(so, prev if self.pp > 1 else None)
            self.remote.reap(self.step_timeout_s)
        except Exception as e:
            self._fail(e)
        self.steps_launched += 1
        if self.pp == 1:
            self._prev = sampled_delta(out)
            return lambda: out
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return functools.partial(self._complete, refs[self.sampler - 1])

    def _complete(self, ref) -> ModelRunnerOutput:
        """pp > 1: the last stage's output of a launched step."""
        try:
            out = ray.get(ref, timeout=self.step_timeout_s)
        except Exception as e:
            self._fail(e)
        self.in_flight -= 1
        for rid, toks in sampled_delta(out).items():  # reach the other ranks with the next step
            self._prev.setdefault(rid, []).extend(toks)
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
            raise EngineDeadError(f"a {self._ranks_word()} did not answer its health ping within 10 s") from None
        except Exception as e:
            self._fail(e)

    def rank_pids(self) -> list[int]:
        return list(self._pids)

    def kv_bytes_per_block(self) -> int:
        return self._bytes_per_block

    def kv_layout(self) -> KVLayout:
        return self.rank0.runner.kv_layout()

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Every rank's heads of these blocks, gathered here: dim 2 is the KV heads (a stage's
        ranks in order), dim 0 the layers (the stages in order). Remote ranks' calls queue
        behind the steps already sent to them."""
        refs = [w.read_kv_blocks.remote(block_ids) for w in self.workers]
        try:
            parts = [self.rank0.read_kv_blocks(block_ids)] + ray.get(refs, timeout=self.step_timeout_s)
        except Exception as e:
            self._fail(e)
        tp = self.tp
        return torch.cat([torch.cat(parts[s * tp : (s + 1) * tp], dim=2) for s in range(self.pp)], dim=0)

    def _rank_share(self, data: torch.Tensor, rank: int) -> torch.Tensor:
        """A rank's part of an every-layer, every-head payload: its stage's layers, its heads."""
        layers = self.stage_layers[rank // self.tp]
        return head_slice(data[layers.start : layers.stop], rank % self.tp, self.tp)

    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Each rank gets only its share of the layers and heads (the two pools' tp and pp may
        differ)."""
        refs = [w.write_kv_blocks.remote(block_ids, self._rank_share(data, r)) for r, w in enumerate(self.workers, 1)]
        try:
            self.rank0.write_kv_blocks(block_ids, self._rank_share(data, 0))
            ray.get(refs, timeout=self.step_timeout_s)
        except Exception as e:
            self._fail(e)

    def warm_up(self, max_tokens: int, max_logit_rows: int) -> None:
        """Every rank at once (each stage its own layers; the LM head's gather is collective)."""
        refs = [w.warm_up.remote(max_tokens, max_logit_rows) for w in self.workers]
        try:
            self.rank0.warm_up(max_tokens, max_logit_rows)
            ray.get(refs, timeout=self.step_timeout_s)
        except Exception as e:
            self._fail(e)

    def measure_step_costs(self, max_batch: int, max_k: int) -> dict[tuple[int, int], float] | None:
        """The speculative verify-step cost table, measured by all ranks together (before any
        request: nothing else is in flight on the group). pp > 1: not measured (a stage's
        forward needs its predecessor's output); the engine assumes cost by tokens."""
        if self.pp > 1:
            return None
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
        logger.error("replica's rank group failed: %s", self._dead)
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
                f"{self._ranks_word()} {ranks} of {self.world}{self._stages(dead)} died (worker actor gone); "
                f"the engine cannot continue (first error seen: {_summary(cause)})"
            )
        if failed:
            # A rank that lost its peer fails too: prefer the one whose error is its own.
            own = [r for r, e in failed.items() if not _lost_peer(e)] or sorted(failed)
            rank = min(own)
            return f"{self._ranks_word()} {rank} of {self.world}{self._stages([rank])} failed: {_summary(failed[rank])}"
        return f"{self._ranks_word()} 0 of {self.world} (in the driver) failed: {_summary(cause)}"

    def _ranks_word(self) -> str:
        return "tensor-parallel rank" if self.pp == 1 else "rank"

    def _stages(self, ranks: list[int]) -> str:
        if self.pp == 1:
            return ""
        return " (pipeline stage " + ", ".join(str(r // self.tp) for r in ranks) + ")"


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
