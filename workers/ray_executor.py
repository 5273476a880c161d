"""The executor for tensor_parallel_size > 1: one Ray actor per rank in a STRICT_PACK
placement group, one torch.distributed group, one model copy and one KV cache between them.

Per step the driver sends only the scheduler's delta (plus the token ids rank 0 sampled last
step); the ranks keep request state. Rank 0 samples and returns the ModelRunnerOutput.
A dead or failed rank becomes an EngineDeadError naming it; the group is then killed so
nothing waits on it, and a new executor can be built in its place.
"""
from __future__ import annotations

import logging
import math
import os

import ray
import torch

from engine.config import CacheConfig, ParallelConfig
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.errors import EngineDeadError
from engine.executor import Executor
from engine.model_config import ModelConfig
from workers.placement import ensure_ray, place_group, rank_resources, release_ray
from workers.sharding import check_tp_compatible
from workers.transport import default_transport, make_transport
from workers.worker import StepInput, TPWorker, sampled_delta

logger = logging.getLogger(__name__)


class RayExecutor(Executor):
    """`placement_group`/`bundle_indices`: run the ranks in the caller's placement group (a Serve
    replica's); by default the current placement group is used when there is one, else a new
    STRICT_PACK group is made. `transport`: "actor_calls" or "compiled_graph" (default: see
    `workers.transport.default_transport`). The KV budget (`kv_cache_memory_bytes`) is per rank."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, parallel: ParallelConfig,
                 device: str | torch.device = "cpu", *, placement_group=None, bundle_indices: list[int] | None = None,
                 transport: str | None = None, num_cpus_per_worker: float = 1.0,
                 step_timeout_s: float | None = None, startup_timeout_s: float = 600.0):
        self.tp = tp = parallel.tensor_parallel_size
        check_tp_compatible(model_config.hf_config, tp)
        self.device = torch.device(device)
        self.step_timeout_s = step_timeout_s or float(os.environ.get("ORBITAL_STEP_TIMEOUT_S", "600"))
        self.workers: list = []
        self.transport = None
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
            self.workers = [
                actor_cls.options(num_cpus=num_cpus_per_worker, num_gpus=gpus, max_restarts=0,
                                  scheduling_strategy=self.placement.strategy(r), name=None)
                .remote(r, tp, str(self.device), max(1, int(num_cpus_per_worker)))
                for r in range(tp)]
            t = startup_timeout_s
            addr, port = ray.get(self.workers[0].open_rendezvous.remote(), timeout=t)
            ray.get([w.join.remote(addr, port) for w in self.workers], timeout=t)
            budgets = ray.get([w.load.remote(model_config, cache_config) for w in self.workers], timeout=t)
            self.num_blocks = min(budgets)
            self._bytes_per_block = ray.get([w.init_kv_cache.remote(self.num_blocks) for w in self.workers], timeout=t)[0]
            kind = transport or default_transport(self.device.type, tp, max(1, int(num_cpus_per_worker)))
            self.transport = make_transport(kind, self.workers)
        except BaseException:
            self.shutdown()
            raise

    # ---- the Executor interface ----
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self._dead:
            raise EngineDeadError(self._dead)
        try:
            out = self.transport.step(StepInput(so, self._prev), self.step_timeout_s)
        except Exception as e:
            self._fail(e)
        self._prev = sampled_delta(out)
        return out

    def check_health(self) -> None:
        if self._dead:
            raise EngineDeadError(self._dead)
        refs = [_control(w.ping).remote() for w in self.workers]
        try:
            ray.get(refs, timeout=10)
        except Exception as e:
            self._fail(e)

    def kv_bytes_per_block(self) -> int:
        return self._bytes_per_block

    def shutdown(self) -> None:
        if self.transport is not None:
            if self._dead:
                self._kill_workers()  # a graph cannot stop loops that wait on a dead peer
            self.transport.close()
            self.transport = None
        self._kill_workers()
        self.workers = []
        if self.placement is not None:
            self.placement.release()
            self.placement = None
        if self._started_ray:
            self._started_ray = False
            release_ray()

    # ---- introspection (tests, benchmarks) ----
    @property
    def transport_name(self) -> str:
        return self.transport.name if self.transport else "closed"

    def worker_info(self) -> list[dict]:
        return ray.get([_control(w.info).remote() for w in self.workers], timeout=30)

    # ---- failure handling ----
    def _fail(self, cause: BaseException):
        self._dead = self._diagnose(cause)
        logger.error("tensor-parallel group failed: %s", self._dead)
        self._kill_workers()  # blocked peers must not keep the group (or a compiled graph) alive
        raise EngineDeadError(self._dead) from cause

    def _diagnose(self, cause: BaseException) -> str:
        """Name the rank(s) that died; fall back to the rank whose step raised."""
        refs = [_control(w.ping).remote() for w in self.workers]
        dead, stuck = [], []
        for r, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=2.0)
            except ray.exceptions.RayActorError:
                dead.append(r)
            except ray.exceptions.GetTimeoutError:
                stuck.append(r)
            except Exception:
                dead.append(r)
        first = _summary(cause)
        if dead:
            ranks = ", ".join(map(str, dead))
            return (f"tensor-parallel rank {ranks} of {self.tp} died (worker actor gone); "
                    f"the engine cannot continue (first error seen: {first})")
        failed = [r for r in range(self.tp) if f"tensor-parallel rank {r} failed" in str(cause)]
        who = f"rank {failed[0]}" if failed else "a rank"
        extra = f"; unresponsive ranks: {stuck}" if stuck else ""
        return f"tensor-parallel {who} of {self.tp} failed{extra}: {first}"

    def _kill_workers(self) -> None:
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass


def _control(method):
    return method.options(concurrency_group="control")


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
