"""One engine replica: a Serve deployment around the AsyncEngine (one per tensor-parallel group).

It sees token ids only; text lives in the router. Methods the router calls through its handle:
  * `submit(request_id, ids, params, router_id)`: start a request, return this replica's id;
  * `output_channel(router_id)` (streaming, `handle.options(stream=True)`): every output of
    that router's requests here, one message per engine step (`router/output_channel.py`);
  * `finish(child_ids)`: the router matched a stop string; end those sequences now;
  * `abort(request_id)`: the client went away; the request ends before the next engine step,
    which returns its KV blocks to the pool;
  * `stats()`, `check_health()` (also Serve's health check).
  * `record_routing_stats()`: Serve polls it; the router's replica choice reads it.
Every method takes an optional `replica_id`: the router pins calls to one replica with it (see
`replica_choice.py`); the replica itself ignores it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time

# As engine/__init__ does: idle OpenMP threads sleep instead of spinning (several replicas on
# few cores). Must precede the first torch import in this worker process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from ray import serve

from engine.async_engine import AsyncEngine
from engine.errors import EngineDeadError, InvalidRequestError
from engine.engine_args import EngineArgs
from engine.sampling_params import SamplingParams
from router.autoscaling_stats import AutoscalingStats
from router.backpressure import ReplicaQueue
from router.metrics import COUNTERS, new_histograms
from router.output_channel import Outbox
from workers.executor_factory import make_executor

log = logging.getLogger(__name__)


class _Job:
    """One request running here: its router's outbox, its pump task, times for the metrics."""

    __slots__ = ("request_id", "children", "router_id", "box", "task", "arrival_wall", "arrival_mono",
                 "first_token", "last_token", "children_done", "stopped")

    def __init__(self, request_id: str, n: int, arrival_wall: float, router_id: str, box: Outbox):
        self.request_id, self.router_id, self.box, self.task = request_id, router_id, box, None
        self.children = [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]
        self.arrival_wall, self.arrival_mono = arrival_wall, time.monotonic()
        self.first_token: float | None = None
        self.last_token: dict[str, float] = {}
        self.children_done: set[str] = set()
        self.stopped: set[str] = set()  # children the router finished (stop string)


@serve.deployment(name="EngineReplica")
class EngineReplica:
    def __init__(self, engine_args: dict, max_queued_requests: int = 64):
        self.engine = AsyncEngine(EngineArgs(**engine_args), executor_factory=make_executor)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - constructed outside Serve (unit use)
            self.replica_id = "local"
        self.queue = ReplicaQueue(max_queued_requests)
        self.hist = new_histograms()
        self.counters = {k: 0 for k in ("prompt_tokens", "generation_tokens")}
        self.finished: dict[str, int] = {}
        self._jobs: dict[str, _Job] = {}  # request id -> running request
        self._outboxes: dict[str, Outbox] = {}  # router id -> its requests' outputs
        self.channel_messages = 0  # output-channel messages sent (vs generation_tokens: batching)
        log.info("engine replica %s ready: %s", self.replica_id, self.engine.model_config.served_name)

    # --- generation -------------------------------------------------------------------------

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     router_id: str, arrival_wall: float | None = None, priority: int = 0,
                     batch_interval_s: float = 0.0, replica_id: str | None = None) -> str:
        """Start a request; its outputs go to `router_id`'s output channel. Returns this
        replica's id (the router pins `output_channel`, `finish` and `abort` to it).
        `batch_interval_s` > 0 (non-streamed requests): after the first output, hand outputs to
        the channel at most that often: fewer router wake-ups, same results."""
        if not self.engine.is_alive():
            raise EngineDeadError("the engine loop is not running")
        if request_id in self._jobs:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        self.queue.admit(request_id)  # raises OverloadedError -> 429 at the router
        box = self._outboxes.get(router_id)
        if box is None:
            box = self._outboxes[router_id] = Outbox(self._step_handed_over)
        job = _Job(request_id, params.n, arrival_wall or time.time(), router_id, box)
        self.counters["prompt_tokens"] += len(prompt_token_ids)
        self._jobs[request_id] = job
        box.active.add(request_id)
        stream = self.engine.generate_tokens(request_id, prompt_token_ids, params, priority,
                                             arrival_time=job.arrival_mono)
        job.task = asyncio.get_running_loop().create_task(self._pump(job, stream, batch_interval_s))
        return self.replica_id

    async def output_channel(self, router_id: str, replica_id: str | None = None):
        """Streaming: every output of `router_id`'s requests here, one message per engine step
        (see `router/output_channel.py`); ends when that router has nothing left here."""
        box = self._outboxes.get(router_id)
        if box is None:
            return
        try:
            async for payload in box.messages():
                self.channel_messages += 1
                yield payload
        finally:
            if box.idle and self._outboxes.get(router_id) is box:
                del self._outboxes[router_id]

    def _step_handed_over(self) -> None:
        """Returns once the engine thread has handed its current step's outputs to this loop
        (blocks the loop for microseconds)."""
        self.engine.step_handed_over()

    async def _pump(self, job: "_Job", stream, batch_interval_s: float) -> None:
        """Moves one request's outputs from the engine to its router's outbox."""
        pending: list = []
        last_sent = 0.0
        try:
            async for out in stream:
                self._observe(job, out)
                if batch_interval_s <= 0:
                    job.box.put(out)
                    continue
                pending.append(out)
                now = time.monotonic()
                if not last_sent or now - last_sent >= batch_interval_s:
                    job.box.extend(pending)
                    pending, last_sent = [], now
            job.box.extend(pending)
        except asyncio.CancelledError:
            pass  # finished by a stop string or aborted by the router: nobody waits for more
        except Exception as e:  # noqa: BLE001 - the router raises it for this request
            job.box.put((job.request_id, e))
        finally:
            self._jobs.pop(job.request_id, None)
            self.queue.done(job.request_id)
            completed = all(c in job.children_done or c in job.stopped for c in job.children)
            if not all(c in job.children_done for c in job.children):
                self.engine.abort(job.request_id)
            await stream.aclose()
            for c in job.children:
                if c not in job.children_done:
                    reason = "stop" if c in job.stopped else "abort"
                    self.finished[reason] = self.finished.get(reason, 0) + 1
            if completed and job.first_token is not None:
                self.hist["e2e_request_latency_seconds"].observe(time.time() - job.arrival_wall)
            job.box.request_done(job.request_id)
            if job.box.idle and self._outboxes.get(job.router_id) is job.box:
                del self._outboxes[job.router_id]  # also when its router never opened a channel

    def _observe(self, job: "_Job", out) -> None:
        rid, now = out.request_id, time.time()
        if out.new_token_ids:
            self.counters["generation_tokens"] += len(out.new_token_ids)
            if job.first_token is None:
                job.first_token = now
                self.queue.started(job.request_id)
                self.hist["time_to_first_token_seconds"].observe(now - job.arrival_wall)
            last = job.last_token.get(rid)
            if last is not None:
                self.hist["inter_token_latency_seconds"].observe(now - last)
            elif out.queue_time is not None:
                self.hist["request_queue_time_seconds"].observe(max(0.0, out.queue_time))
            job.last_token[rid] = now
        if out.finished:
            job.children_done.add(rid)
            reason = out.finish_reason or "abort"
            self.finished[reason] = self.finished.get(reason, 0) + 1

    async def finish(self, child_ids: list[str], replica_id: str | None = None) -> None:
        """The router matched a stop string: end these sequences now (frees their KV). The
        engine sends nothing more for them, so a request whose sequences are all over ends."""
        self.engine.finish(child_ids)
        for parent in {c.split("#", 1)[0] for c in child_ids}:
            job = self._jobs.get(parent)
            if job is None:
                continue
            job.stopped.update(c for c in child_ids if c in job.children)
            if all(c in job.children_done or c in job.stopped for c in job.children) and job.task:
                job.task.cancel()

    async def abort(self, request_id: str, replica_id: str | None = None) -> None:
        job = self._jobs.get(request_id)
        if job is not None and job.task is not None:
            job.task.cancel()  # its cleanup aborts it in the engine before the next step
        else:
            self.engine.abort(request_id)

    # --- health and stats -------------------------------------------------------------------

    async def check_health(self, replica_id: str | None = None) -> None:
        if not self.engine.is_alive():
            raise EngineDeadError("the engine loop is not running")

    async def stats(self, replica_id: str | None = None) -> dict:
        s = self.engine.stats()
        s.update(self.counters)
        s["replica_id"] = self.replica_id
        s["channel_messages"] = self.channel_messages
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
