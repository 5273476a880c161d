"""The text side of one request, in the ingress: token ids go to an engine replica, token ids come
back, and the engine's OutputProcessor turns them into RequestOutputs (incremental text, stop
strings, n>1 aggregation) here. Messages to and from replicas: `router/messages.py`.

A request is started with `submit` (a unary call; the replica choice picks the replica); its
outputs come back on that replica's output channel (`router/ingress/output_reader.py`), one message
per engine step for all of this ingress's requests there, and are detokenized here in one
OutputProcessor call per message.

A stop string is found here, not in the engine: the ingress calls the replica's `finish` for
those sequences (pinned to the replica that holds them) so their KV blocks are freed at once.
When the caller stops reading (client gone, timeout, error), the ingress calls `abort` on the
replica, which ends the request before its next step.

When the replica dies or is drained mid-request, the request moves on to another replica as a
continuation, inside `generate` (`router/ingress/failover.py`, `drain_watch.py`).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, TypeVar

import router.tracing as tracing
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.request import child_request_ids, parent_request_id
from engine.sampling_params import SamplingParams
from engine.text.input_processor import InputProcessor
from engine.text.output_processor import OutputProcessor
from router.backpressure import IngressQueue
from router.ingress.drain_watch import DrainWatch
from router.ingress.failover import (
    Migration,
    MigrationFailedError,
    ReplicaDrainingError,
    ReplicaLostError,
    continuation,
    moves_request,
    note_replica_failure,
)
from router.ingress.kv_subscriber import KVSubscriber
from router.ingress.lease_renewal import LeaseRenewal
from router.ingress.output_reader import OutputReader
from router.messages import AbortRequest, FinishSequences, StepOutputs, SubmitRequest
from router.replica_choice.routing_state import routing_state

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
T = TypeVar("T")


# Outputs (engine steps) one request may have waiting for its reader before it is cut off.
MAX_PENDING_OUTPUTS = 512


class SlowReaderError(TimeoutError):
    """The request's reader fell too far behind its outputs; the request was aborted."""


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _routing_attributes(request_id: str, replica: str) -> dict:
    """The replica choice of a routed request, as span attributes."""
    d = routing_state().log.decision(request_id)
    out = {"orbital.replica": replica}
    if d is not None:
        out.update(
            {"orbital.routing.policy": d.policy, "orbital.routing.predicted_cached_tokens": d.predicted_cached_tokens}
        )
    return out


class EngineClient:
    """Runs requests on the engine deployment through a DeploymentHandle."""

    def __init__(
        self,
        handle: DeploymentHandle,
        tokenizer: PreTrainedTokenizerBase,
        inputs: InputProcessor,
        queue: IngressQueue,
        control_timeout_s: float = 10.0,
        nonstream_batch_interval_s: float = 0.0,
        max_migrations: int = 3,
        drain_timeout_s: float = 30.0,
        router_lease_s: float = 30.0,
    ) -> None:
        self.handle = handle
        self.nonstream_batch_interval_s = nonstream_batch_interval_s
        self.queue = queue
        self.tokenizer = tokenizer
        self.inputs = inputs
        self.outputs = OutputProcessor(tokenizer)
        self.control_timeout_s = control_timeout_s
        self.channels = OutputReader(handle.options(stream=True), self._on_batch, self._on_channel_error)
        self.kv_feed = KVSubscriber(handle)  # cache-aware routing's index of replicas' blocks
        self.kv_feed.start()
        self._waiting: dict[str, asyncio.Queue] = {}  # request id -> its outputs (or an exception)
        self._background: set[asyncio.Task] = set()
        self.replica_counts: dict[str, int] = {}  # requests ended per replica (tests, debugging)
        self.max_migrations = max_migrations
        self.migrations = self.migration_failures = 0  # /metrics
        self._left: dict[str, set[str]] = {}  # request id -> replicas it moved off (late outputs dropped)
        self._cut: set[str] = set()  # requests whose reader fell behind (their outputs dropped)
        self.drains = DrainWatch(handle, self.channels, drain_timeout_s, self._drained)
        self.leases = LeaseRenewal(handle, self.channels, router_lease_s)

    def stats(self) -> dict:
        """The router queue's figures plus failover counters (/metrics)."""
        return {
            **self.queue.stats(),
            "migrations": self.migrations,
            "migration_failures": self.migration_failures,
            "channel_socket_messages": self.channels.socket.frames,
            "channel_call_messages": self.channels.call_messages,
        }

    async def text_work(self, num_requests: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` (tokenizing, a chat template) off the event loop, once the router queue has
        room for `num_requests` more: a full queue answers 429 before any text work, and a long
        prompt's tokenizing does not stall every stream of this router."""
        self.queue.check_room(num_requests)
        return await asyncio.to_thread(fn, *args)

    def token_text(self, token_id: int) -> str:
        """One token's text (logprobs, TGI token lists)."""
        return self.outputs.token_text(token_id)

    async def generate(
        self,
        request_id: str,
        prompt_text: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_wall: float | None = None,
        priority: int = 0,
        stream: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """RequestOutputs of one request. `stream=False`: the caller only wants the end, so the
        replica may hand over several steps at once (`nonstream_batch_interval_s`). When its
        replica dies or is drained, the request moves on to another (`failover.py`)."""
        self.queue.admit(request_id)  # OverloadedError (429) before any work
        self.kv_feed.start()
        self.drains.start()
        self.leases.start()
        submit = replica = None
        added = done = False
        child_ids = child_request_ids(request_id, params.n)
        moving = Migration(self.max_migrations)
        span = tracing.current_span()  # the router's span of this request (None: not traced)
        try:
            self.inputs.check_request(prompt_ids, params)  # the engine's own checks, before sending
            self.outputs.add_request(request_id, prompt_text, prompt_ids, params, child_ids)
            added = True
            # Registered before submitting: the channel may bring outputs before the reply.
            outputs = self._waiting[request_id] = asyncio.Queue()
            msg = SubmitRequest(
                request_id,
                prompt_ids,
                params,
                self.channels.ingress_id,
                arrival_wall or time.time(),
                priority,
                0.0 if stream else self.nonstream_batch_interval_s,
                lora_request=lora_request,
                traceparent=tracing.traceparent(span),
            )
            first, last = True, None
            while not done:
                try:
                    # Outside the caller's Serve request context, as every call below: Serve
                    # cancels a request's calls when it is cancelled, and then `abort` must
                    # still get through.
                    route = None
                    if span is not None:
                        attributes = tracing.attributes_of(request_id=request_id, attempt=moving.moves)
                        route = tracing.start_span("orbital.route", span, attributes)
                    submit = asyncio.ensure_future(contextvars.Context().run(self.handle.submit.remote, msg))
                    try:
                        replica = await asyncio.shield(submit)  # 429 from the replica, engine dead, ...
                    except BaseException as e:
                        tracing.end(route, error=e)
                        raise
                    routing_state().confirmed(request_id, replica)
                    if route is not None:
                        tracing.end(route, _routing_attributes(request_id, replica))
                    self.channels.attach(replica, request_id)
                    while not done:
                        out = await outputs.get()
                        if isinstance(out, BaseException):
                            raise out
                        if first:
                            self.queue.started(request_id)
                            first = False
                        done = out.finished
                        if done:
                            routing_state().log.finished(request_id, out.num_cached_tokens)
                        last = out
                        yield out
                except Exception as e:
                    if not moves_request(e):
                        raise
                    left = replica
                    msg = self._move(msg, moving, replica, e, last, child_ids)
                    reason = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                    moved = tracing.attributes_of(from_replica=left, move=moving.moves, error=reason)
                    tracing.event(span, "orbital.migration", moved)
                    submit = replica = None
        finally:
            self.queue.done(request_id)
            self._waiting.pop(request_id, None)
            self._cut.discard(request_id)
            self._left.pop(request_id, None)
            if submit is not None:
                routing_state().ended(request_id)
            if added and not done:
                self.outputs.abort_request(request_id)
            if replica is not None:
                # Counted when it ends (tests read "requests that ended on a replica" from it).
                self.replica_counts[replica] = self.replica_counts.get(replica, 0) + 1
                self.channels.detach(replica, request_id)
                if not done:  # the caller went away: end it in the engine
                    self._spawn(self._control("abort", AbortRequest(request_id), replica))
            elif submit is not None and not (submit.done() and (submit.cancelled() or submit.exception())):
                # Left while `submit` was in flight (or as it returned): abort where it lands.
                self._spawn(self._abort_when_submitted(submit, request_id))

    def _move(
        self,
        msg: SubmitRequest,
        moving: Migration,
        replica: str | None,
        error: BaseException,
        last: RequestOutput | None,
        child_ids: list[str],
    ) -> SubmitRequest:
        """The request's replica failed: the SubmitRequest that continues it elsewhere (raises
        MigrationFailedError when it may not move)."""
        rid = msg.request_id
        note_replica_failure(replica, error)
        try:
            moving.next_move(replica, error, msg.params)
        except MigrationFailedError:
            self.migration_failures += 1
            raise
        self.migrations += 1
        if replica is not None:
            self._left.setdefault(rid, set()).add(replica)  # its late outputs are dropped
            self.channels.detach(replica, rid)
        routing_state().ended(rid)
        resume, params = continuation(last, child_ids, msg.params)
        log.warning(
            "request %s moves off replica %s (%s): move %d, %s tokens so far",
            rid,
            replica,
            error,
            moving.moves,
            None if resume is None else sum(map(len, resume.values())),
        )
        return dataclasses.replace(msg, params=params, resume=resume, avoid_replicas=moving.left)

    # --- the output channels ----------------------------------------------------------------

    def _on_batch(self, replica: str, msg: StepOutputs) -> None:
        """One channel message: every output of one engine step for this ingress's requests."""
        if msg.kv_events:  # ahead of the outputs they came with
            routing_state().kv_index.apply(replica, msg.kv_events)
        outputs = msg.outputs
        if self._left:  # a request that moved off this replica takes nothing more from it
            outputs = [o for o in outputs if replica not in self._left.get(parent_request_id(o.request_id), ())]
        for failed in msg.failures:
            if replica not in self._left.get(failed.request_id, ()):
                self._deliver(replica, failed.request_id, failed.error)
        if not outputs:
            return
        request_outputs, stop_ids = self.outputs.process_outputs(outputs)
        if stop_ids:
            self._spawn(self._control("finish", FinishSequences(stop_ids), replica))
        for out in request_outputs:
            self._deliver(replica, out.request_id, out)

    def _deliver(self, replica: str, request_id: str, item) -> None:
        q = self._waiting.get(request_id)
        if request_id in self._cut:
            return  # its reader fell behind: it ends with the error already queued
        failed = isinstance(item, BaseException)
        if not failed and q is not None and q.qsize() >= MAX_PENDING_OUTPUTS:
            # The caller stopped reading (a client that does not read its stream): end the
            # request now, so its KV blocks and batch slot go back, not when its write times out.
            self._cut.add(request_id)
            q.put_nowait(SlowReaderError(f"the client fell {MAX_PENDING_OUTPUTS} engine steps behind the stream"))
            self._spawn(self._control("abort", AbortRequest(request_id), replica))
            self.channels.detach(replica, request_id)
            return
        if failed and q is not None and moves_request(item):
            # From now on nothing of this replica counts for the request: it goes on elsewhere
            # from what the caller has been given up to this error.
            self._left.setdefault(request_id, set()).add(replica)
        if q is not None:
            q.put_nowait(item)
        if failed or item.finished:
            self.channels.detach(replica, request_id)  # nothing more will come for it

    def _on_channel_error(self, replica: str, request_ids: list[str], error: BaseException) -> None:
        note_replica_failure(replica, error)
        lost = ReplicaLostError(f"output channel of engine replica {replica} failed: {error}")
        for rid in request_ids:
            self._deliver(replica, rid, lost)

    def _drained(self, replica: str, request_ids: list[str]) -> None:
        """The replica is being removed and these requests outlived the drain budget."""
        err = ReplicaDrainingError(f"engine replica {replica} is being removed (drain budget over)")
        for rid in request_ids:
            self._deliver(replica, rid, err)

    # --- control calls ----------------------------------------------------------------------

    async def _control(self, method: str, arg: FinishSequences | AbortRequest, replica: str) -> None:
        try:
            await asyncio.wait_for(getattr(self.handle, method).remote(arg, replica_id=replica), self.control_timeout_s)
        except Exception as e:  # noqa: BLE001 - the request ends anyway when its tokens run out
            log.warning("%s(%s) on replica %s failed: %s", method, arg, replica, e)

    async def _abort_when_submitted(self, submit, request_id: str) -> None:
        """The caller left while `submit` was in flight: abort wherever it landed."""
        try:
            replica = await submit
        except Exception:  # noqa: BLE001 - never started
            return
        await self._control("abort", AbortRequest(request_id), replica)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
