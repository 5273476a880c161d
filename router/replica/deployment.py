"""One engine replica: a Serve deployment around the AsyncEngine (one per tensor-parallel group).

It sees token ids only; text lives in the ingress. Methods the ingress calls through its
handle, with the messages of `router/messages.py`:
  * `submit(SubmitRequest)`: start a request, return this replica's id;
  * `output_channel(ingress_id)` (streaming, `handle.options(stream=True)`): every output of
    that ingress's requests here, one `StepOutputs` per engine step (`router/replica/outbox.py`);
  * `finish(FinishSequences)`: the ingress matched a stop string; end those sequences now;
  * `abort(AbortRequest)`: the client went away; the request ends before the next engine step,
    which returns its KV blocks to the pool;
  * `kv_events(epoch, seq)` (streaming): the engine's KV event batches after `seq` (or a
    snapshot first, when those are gone or the epoch is another engine's), for a few seconds;
    the ingress's cache-aware routing calls it again and again (router/ingress/kv_subscriber.py).
    The same batches also ride on the output channels of ingresses with requests here;
  * `export_cached_kv(ExportCachedKV)` (from a replica of the same pool): blocks of a prompt's
    prefix read out of this replica's prefix cache, as a KVHandle (router/replica/peer_fetch.py);
  * `renew_lease(ingress_id)`: that router is alive; one not heard from for a lease has its
    requests here aborted (`RouterLeases`, the class's base: router/replica/router_leases.py);
  * `check_health()` (also Serve's health check);
  * `stats()`, and for Serve `record_routing_stats()` and `record_autoscaling_stats()`: from
    `ReplicaStats`, the class's base (router/replica/replica_stats.py).
Every method takes an optional `replica_id`: the ingress pins calls to one replica with it (see
`router/replica_choice/`); the replica itself ignores it. Load figures come from the engine's
stats snapshot (published after each step), never from the scheduler's live structures.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator

import ray
from ray import serve
from ray.actor import ActorHandle
from ray.serve.handle import DeploymentHandle

import router.tracing as tracing

# The first torch import in this process; the `engine` package sets OpenMP's wait defaults before it.
from engine.async_engine import AsyncEngine
from engine.engine_args import EngineArgs
from engine.errors import EngineDeadError, InvalidRequestError
from engine.model.text_side import text_side_files
from engine.request import child_request_ids, parent_request_id
from router.backpressure import ReplicaQueue
from router.channel_socket import ChannelWriter
from router.messages import (
    AbortRequest,
    ChannelSocket,
    ChannelSocketEnd,
    ExportCachedKV,
    FinishSequences,
    PrefillKV,
    PrefillKVDone,
    SubmitRequest,
    TextSideFiles,
    encode,
)
from router.metrics import new_histograms
from router.replica.job import Job
from router.replica.kv_feed import KVFeed
from router.replica.kv_transport import KVHandle
from router.replica.outbox import Outbox
from router.replica.peer_fetch import PeerFetches
from router.replica.prefill_client import RemotePrefills, prefill_kv
from router.replica.replica_stats import ReplicaStats
from router.replica.router_leases import RouterLeases
from workers.executor_factory import make_executor

log = logging.getLogger(__name__)


@serve.deployment(name="EngineReplica")
class EngineReplica(RouterLeases, ReplicaStats):
    def __init__(
        self,
        engine_args: dict,
        max_queued_requests: int = 64,
        stuck_step_timeout_s: float = 120.0,
        prefill: DeploymentHandle | None = None,
        kv_transfer_failure: str = "recompute",
        kv_transfer_timeout_s: float = 60.0,
        router_lease_s: float = 30.0,
        otlp_traces_endpoint: str | None = None,
    ) -> None:
        """`prefill` (decode replicas of a disaggregated app): the prefill pool's handle.
        `router_lease_s`: a router not heard from that long (no request, no lease renewal) while
        it has requests here is taken for dead: its requests are aborted, its outbox dropped.
        `otlp_traces_endpoint`: AppConfig's (router/tracing.py: None leaves it to OTEL_* variables)."""
        tracing.setup("engine", otlp_traces_endpoint)
        self.engine = AsyncEngine(EngineArgs(**engine_args), executor_factory=make_executor)
        self.stuck_step_timeout_s = stuck_step_timeout_s
        self.router_lease_s = router_lease_s
        self._lease_task: asyncio.Task | None = None
        self.lease_expiries = 0  # routers taken for dead (stats)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - constructed outside Serve (unit use)
            self.replica_id = "local"
        self.queue = ReplicaQueue(max_queued_requests)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.hist = new_histograms()
        self.counters = {k: 0 for k in ("prompt_tokens", "generation_tokens", "migrated_in")}
        self.finished: dict[str, int] = {}
        self._jobs: dict[str, Job] = {}  # request id -> running request
        self._outboxes: dict[str, Outbox] = {}  # ingress id -> its requests' outputs
        self.channel_messages = 0  # output-channel messages sent (vs generation_tokens: batching)
        self.kv_feed = KVFeed(self.engine.kv_events, self._outboxes.values)
        self.remote_prefills = (
            RemotePrefills(
                self.engine, prefill, self.hist, kv_transfer_failure, kv_transfer_timeout_s, span_of=self._span_of
            )
            if prefill is not None
            else None
        )
        self._pool: DeploymentHandle | None = None  # this pool's own handle, for fetches from peers
        self.peer_fetches = PeerFetches(self.engine, self._pool_handle, self.hist, span_of=self._span_of)
        self._kv_bytes_per_block = self.engine.kv_layout.bytes_per_block
        self.engine.on_kv_loads = self._kv_loads
        log.info("engine replica %s ready: %s", self.replica_id, self.engine.model_config.served_name)

    # --- generation -------------------------------------------------------------------------

    async def submit(self, msg: SubmitRequest, replica_id: str | None = None) -> str:
        """Start a request; its outputs go to `msg.ingress_id`'s output channel. Returns this
        replica's id (the ingress pins `output_channel`, `finish` and `abort` to it)."""
        if not self.engine.is_alive():
            raise EngineDeadError("the engine loop is not running")
        self.kv_feed.loop = asyncio.get_running_loop()
        if self._lease_task is None:
            self._lease_task = self.kv_feed.loop.create_task(self._expire_leases())
        if self.remote_prefills is not None:
            self.remote_prefills.loop = self.kv_feed.loop
        self.peer_fetches.loop = self.kv_feed.loop
        rid = msg.request_id
        if rid in self._jobs:
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        self.queue.admit(rid)  # raises OverloadedError -> 429 at the ingress
        box = self._outboxes.get(msg.ingress_id)
        if box is None:
            box = self._outboxes[msg.ingress_id] = Outbox(self._step_handed_over)
        box.last_seen = time.monotonic()
        children = child_request_ids(rid, msg.params.n)
        if msg.resume is not None:  # moved here: only its unfinished sequences go on
            children = [c for c in children if c in msg.resume]
            self.counters["migrated_in"] += 1
        else:
            self.counters["prompt_tokens"] += len(msg.prompt_token_ids)
        job = Job(rid, children, msg.arrival_wall, msg.ingress_id, box)
        if msg.traceparent is not None:
            job.trace = tracing.EngineRequestTrace.start(
                msg.traceparent,
                tracing.attributes_of(
                    request_id=rid, replica=self.replica_id, n=msg.params.n, resumed=msg.resume is not None or None
                ),
                len(msg.prompt_token_ids),
            )
        self._jobs[rid] = job
        box.active.add(rid)
        stream = self.engine.generate_tokens(
            rid,
            msg.prompt_token_ids,
            msg.params,
            msg.priority,
            arrival_time=job.arrival_mono,
            resume=msg.resume,
            lora_request=msg.lora_request,
            # A hint naming this very replica: the router ranked the holder first after all.
            peer_prefix=msg.peer_prefix if msg.peer_prefix and msg.peer_prefix.source != self.replica_id else None,
        )
        job.task = asyncio.get_running_loop().create_task(self._pump(job, stream, msg.batch_interval_s))
        return self.replica_id

    async def output_channel(
        self,
        ingress_id: str,
        replica_id: str | None = None,
        router: ActorHandle | None = None,
        socket: ChannelSocket | None = None,
    ) -> AsyncIterator[bytes]:
        """Streaming: every output of `ingress_id`'s requests here, one encoded StepOutputs per
        engine step (see `router/replica/outbox.py`); ends when that ingress has nothing left here.
        `router`: the ingress's own actor, asked whether it lives when its lease runs out.
        `socket`: the ingress's local socket: on its node the StepOutputs go there and the call
        yields one ChannelSocketEnd at its end (router/channel_socket.py)."""
        box = self._outboxes.get(ingress_id)
        if box is None:
            return
        if router is not None:
            box.router = router
        writer = await ChannelWriter.connect(socket, self.node_id)
        try:
            async with contextlib.aclosing(box.messages()) as batches:  # closed at once if cancelled
                async for payload in batches:
                    self.channel_messages += 1
                    if writer is None:
                        yield payload
                    elif not await writer.send(payload):
                        break  # the ingress is gone: its lease ends its requests here
            if writer is not None:
                await writer.close()
                yield encode(ChannelSocketEnd(writer.frames))
        finally:
            if writer is not None:
                await writer.close()
            self._drop_outbox_when_done(ingress_id, box)

    def _drop_outbox_when_done(self, ingress_id: str, box: Outbox) -> None:
        """Forget an ingress's outbox once it has nothing to send or run and no channel reads it
        (also when its ingress never opened a channel)."""
        if box.droppable and self._outboxes.get(ingress_id) is box:
            del self._outboxes[ingress_id]

    # --- KV events ------------------------------------------------------------------------

    async def kv_events(self, epoch: str | None, seq: int, replica_id: str | None = None) -> AsyncIterator[bytes]:
        """Streaming: one KVEventsUpdate at once (a snapshot when the batches after `seq` of
        `epoch` are gone), then one per step that changes the cached hashes, for a few seconds
        (router/replica/kv_feed.py)."""
        async with contextlib.aclosing(self.kv_feed.stream(epoch, seq)) as updates:
            async for payload in updates:
                yield payload

    def _step_handed_over(self) -> None:
        """Returns once the engine thread has handed its current step's outputs to this loop
        (blocks the loop for microseconds)."""
        self.engine.step_handed_over()

    async def _pump(self, job: Job, stream, batch_interval_s: float) -> None:
        """Moves one request's outputs from the engine to its ingress's outbox."""
        pending: list = []
        last_sent = 0.0
        error: BaseException | None = None
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
            pass  # finished by a stop string or aborted by the ingress: nobody waits for more
        except Exception as e:  # noqa: BLE001 - the ingress raises it for this request
            error = e
            job.box.fail(job.request_id, e)
        finally:
            self._jobs.pop(job.request_id, None)
            self.queue.done(job.request_id)
            completed = all(c in job.children_done or c in job.stopped for c in job.children)
            if not all(c in job.children_done for c in job.children):
                self.engine.abort(job.request_id)
            if self.remote_prefills is not None:
                self.remote_prefills.cancel(job.children)
            self.peer_fetches.cancel(job.children)
            await stream.aclose()
            for c in job.children:
                if c not in job.children_done:
                    reason = "stop" if c in job.stopped else "abort"
                    self.finished[reason] = self.finished.get(reason, 0) + 1
            if completed and job.first_token is not None:
                self.hist["e2e_request_latency_seconds"].observe(time.time() - job.arrival_wall)
            if job.trace is not None:
                job.trace.close(error, aborted=not completed and error is None)
            job.box.request_done(job.request_id)
            self._drop_outbox_when_done(job.ingress_id, job.box)

    def _observe(self, job: Job, out) -> None:
        rid, now = out.request_id, time.time()
        if job.trace is not None:
            job.trace.output(
                len(out.new_token_ids),
                out.queue_time,
                out.num_cached_tokens,
                out.finish_reason,
                self.engine.step_count,
                self.engine.snapshot.num_running,
            )
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

    async def finish(self, msg: FinishSequences, replica_id: str | None = None) -> None:
        """The ingress matched a stop string: end these sequences now (frees their KV). The
        engine sends nothing more for them, so a request whose sequences are all over ends."""
        child_ids = msg.sequence_ids
        self.engine.finish(child_ids)
        for parent in {parent_request_id(c) for c in child_ids}:
            job = self._jobs.get(parent)
            if job is None:
                continue
            job.stopped.update(c for c in child_ids if c in job.children)
            if all(c in job.children_done or c in job.stopped for c in job.children) and job.task:
                job.task.cancel()

    async def abort(self, msg: AbortRequest, replica_id: str | None = None) -> None:
        job = self._jobs.get(msg.request_id)
        if job is not None and job.task is not None:
            job.task.cancel()  # its cleanup aborts it in the engine before the next step
        else:
            self.engine.abort(msg.request_id)

    def _span_of(self, sequence_id: str):
        """The engine span of the request a sequence belongs to (None: not traced)."""
        job = self._jobs.get(parent_request_id(sequence_id))
        return None if job is None or job.trace is None else job.trace.span

    def _kv_loads(self, loads: list) -> None:
        """On the engine's step thread: the KV the engine waits for, from a peer (`source` set)
        or the prefill pool."""
        peer = [x for x in loads if x.source is not None]
        remote = [x for x in loads if x.source is None]
        if peer:
            self.peer_fetches.start(peer)
        if remote and self.remote_prefills is not None:
            self.remote_prefills.start(remote)
        else:
            for load in remote:  # no prefill pool here: prefill locally
                self.engine.kv_load_failed(load.request_id)

    def _pool_handle(self) -> DeploymentHandle:
        if self._pool is None:
            ctx = serve.get_replica_context()
            self._pool = serve.get_deployment_handle(ctx.deployment, ctx.app_name)
        return self._pool

    async def export_cached_kv(self, msg: ExportCachedKV, replica_id: str | None = None) -> KVHandle | None:
        """A peer of this pool fetches a prompt's prefix cached here (None: not all cached)."""
        return await self.peer_fetches.export(msg)

    async def prefill_kv(self, msg: PrefillKV, replica_id: str | None = None) -> PrefillKVDone:
        """Prefill pool: compute a decode replica's prompt and hand over its KV blocks."""
        self.counters["prompt_tokens"] += len(msg.prompt_token_ids)
        return await prefill_kv(self.engine, msg, self.replica_id)

    # --- health -----------------------------------------------------------------------------

    async def check_health(self, replica_id: str | None = None) -> None:
        """Serve's health check and the router's /health: raises when the loop died or is stuck
        in a step, or a tensor-parallel rank is gone (Serve then replaces this replica and the
        router moves its requests)."""
        await asyncio.to_thread(self.engine.check_health, self.stuck_step_timeout_s)

    async def text_side(self, replica_id: str | None = None) -> TextSideFiles:
        """The model's tokenizer and config files, for an ingress where the path is missing."""
        return TextSideFiles(text_side_files(self.engine.model_config.model_dir))

    def __del__(self) -> None:
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001
            pass
