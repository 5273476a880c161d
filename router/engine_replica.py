"""One engine replica: a Serve deployment around the AsyncEngine (one per tensor-parallel group).

It sees token ids only; text lives in the router. Methods the router calls through its handle:
  * `generate_tokens` (async generator, `handle.options(stream=True)`): yields
    `(replica_id, [EngineCoreOutput, ...])` per engine step. Cancelling the call (client gone)
    aborts the request before the next engine step, which returns its KV blocks to the pool.
  * `finish(child_ids)`: the router matched a stop string; end those sequences now.
  * `abort(request_id)`, `stats()`, `check_health()` (also Serve's health check).
  * `record_routing_stats()`: Serve polls it; the router's replica choice reads it.
Every method takes an optional `replica_id`: the router pins calls to one replica with it (see
`replica_choice.py`); the replica itself ignores it.
"""
from __future__ import annotations

import logging
import os
import time

# As engine/__init__ does: idle OpenMP threads sleep instead of spinning (several replicas on
# few cores). Must precede the first torch import in this worker process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from ray import serve

from engine.async_engine import AsyncEngine
from engine.errors import EngineDeadError
from engine.llm_engine import EngineArgs
from engine.sampling_params import SamplingParams
from router.autoscaling_stats import AutoscalingStats
from router.backpressure import ReplicaQueue
from router.metrics import COUNTERS, new_histograms

log = logging.getLogger(__name__)


class _RequestTimes:
    __slots__ = ("arrival_wall", "arrival_mono", "first_token", "last_token", "children_done")

    def __init__(self, arrival_wall: float):
        self.arrival_wall, self.arrival_mono = arrival_wall, time.monotonic()
        self.first_token: float | None = None
        self.last_token: dict[str, float] = {}
        self.children_done: set[str] = set()


@serve.deployment(name="EngineReplica")
class EngineReplica:
    def __init__(self, engine_args: dict, max_queued_requests: int = 64):
        self.engine = AsyncEngine(EngineArgs(**engine_args))
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - constructed outside Serve (unit use)
            self.replica_id = "local"
        self.queue = ReplicaQueue(max_queued_requests)
        self.hist = new_histograms()
        self.counters = {k: 0 for k in ("prompt_tokens", "generation_tokens")}
        self.finished: dict[str, int] = {}
        self._stopped: set[str] = set()  # children the router finished (stop string)
        self._active: set[str] = set()  # children of requests in flight here
        log.info("engine replica %s ready: %s", self.replica_id, self.engine.model_config.served_name)

    # --- generation -------------------------------------------------------------------------

    async def generate_tokens(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                              arrival_wall: float | None = None, priority: int = 0,
                              batch_interval_s: float = 0.0, replica_id: str | None = None):
        """`batch_interval_s` > 0 (non-streamed requests): after the first output, send outputs
        at most that often, several steps per message: fewer messages, same results."""
        self.queue.admit(request_id)  # raises OverloadedError -> 429 at the router
        times = _RequestTimes(arrival_wall or time.time())
        n = params.n
        children = [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]
        self.counters["prompt_tokens"] += len(prompt_token_ids)
        self._active.update(children)
        stream = self.engine.generate_tokens(request_id, prompt_token_ids, params, priority,
                                             arrival_time=times.arrival_mono)
        pending: list = []
        last_sent = 0.0
        try:
            async for out in stream:
                self._observe(times, out)
                pending.append(out)
                now = time.monotonic()
                if batch_interval_s <= 0 or not last_sent or now - last_sent >= batch_interval_s:
                    yield self.replica_id, pending
                    pending, last_sent = [], now
            if pending:
                yield self.replica_id, pending
        finally:
            # Serve does not close a cancelled generator at once: abort here, not at GC time.
            self.queue.done(request_id)
            self._active.difference_update(children)
            completed = all(c in times.children_done or c in self._stopped for c in children)
            if not all(c in times.children_done for c in children):
                self.engine.abort(request_id)
            await stream.aclose()
            for c in children:
                if c not in times.children_done:
                    reason = "stop" if c in self._stopped else "abort"
                    self.finished[reason] = self.finished.get(reason, 0) + 1
                self._stopped.discard(c)
            if completed and times.first_token is not None:
                self.hist["e2e_request_latency_seconds"].observe(time.time() - times.arrival_wall)

    def _observe(self, times: _RequestTimes, out) -> None:
        rid, now = out.request_id, time.time()
        if out.new_token_ids:
            self.counters["generation_tokens"] += len(out.new_token_ids)
            if times.first_token is None:
                times.first_token = now
                self.queue.started(rid.split("#", 1)[0])
                self.hist["time_to_first_token_seconds"].observe(now - times.arrival_wall)
            last = times.last_token.get(rid)
            if last is not None:
                self.hist["inter_token_latency_seconds"].observe(now - last)
            elif out.queue_time is not None:
                self.hist["request_queue_time_seconds"].observe(max(0.0, out.queue_time))
            times.last_token[rid] = now
        if out.finished:
            times.children_done.add(rid)
            reason = out.finish_reason or "abort"
            self.finished[reason] = self.finished.get(reason, 0) + 1

    async def finish(self, child_ids: list[str], replica_id: str | None = None) -> None:
        self._stopped.update(c for c in child_ids if c in self._active)
        self.engine.finish(child_ids)

    async def abort(self, request_id: str, replica_id: str | None = None) -> None:
        self.engine.abort(request_id)

    # --- health and stats -------------------------------------------------------------------

    async def check_health(self, replica_id: str | None = None) -> None:
        if not self.engine.is_alive():
            raise EngineDeadError("the engine loop is not running")

    async def stats(self, replica_id: str | None = None) -> dict:
        s = self.engine.stats()
        s.update(self.counters)
        s["replica_id"] = self.replica_id
        s["finished"] = dict(self.finished)
        s["histograms"] = {k: h.to_dict() for k, h in self.hist.items()}
        s["queue"] = self.queue.stats()
        s["alive"] = self.engine.is_alive()
        for k in COUNTERS:
            s.setdefault(k, 0)
        return s

    def record_routing_stats(self) -> dict:
        """Cheap, lock-free load figures for replica choice (Serve polls this)."""
        sched = self.engine.engine.core.scheduler
        return {"num_running": len(sched.running), "num_waiting": len(sched.waiting),
                "kv_usage": sched.kv_cache_manager.usage(), "queued": len(self.queue.queued),
                "in_flight": self.queue.in_flight}

    def record_autoscaling_stats(self) -> dict:
        """Load figures for the autoscaling policy (Serve polls this when autoscaling is on)."""
        if not hasattr(self, "_autoscaling_stats"):
            self._autoscaling_stats = AutoscalingStats(self)
        return self._autoscaling_stats.snapshot()

    def __del__(self):
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001
            pass
