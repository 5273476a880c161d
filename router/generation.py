"""The text side of one request, in the router: token ids go to an engine replica, token ids come
back, and the engine's OutputProcessor turns them into RequestOutputs (incremental text, stop
strings, n>1 aggregation) here.

A request is started with `submit` (a unary call; the replica choice picks the replica); its
outputs come back on that replica's output channel (`router/channel_client.py`), one message
per engine step for all of this router's requests there, and are detokenized here in one
OutputProcessor call per message.

A stop string is found here, not in the engine: the router calls the replica's `finish` for
those sequences (pinned to the replica that holds them) so their KV blocks are freed at once.
When the caller stops reading (client gone, timeout, error), the router calls `abort` on the
replica, which ends the request before its next step.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from typing import AsyncIterator

from engine.input_processor import InputProcessor
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from router.backpressure import RouterQueue
from router.channel_client import ReplicaChannels
from router.replica_choice import local_load

log = logging.getLogger(__name__)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class EngineClient:
    """Runs requests on the engine deployment through a DeploymentHandle."""

    def __init__(self, handle, tokenizer, inputs: InputProcessor, queue: RouterQueue,
                 control_timeout_s: float = 10.0, nonstream_batch_interval_s: float = 0.0):
        self.handle = handle
        self.nonstream_batch_interval_s = nonstream_batch_interval_s
        self.queue = queue
        self.tokenizer = tokenizer
        self.inputs = inputs
        self.outputs = OutputProcessor(tokenizer)
        self.control_timeout_s = control_timeout_s
        self.channels = ReplicaChannels(handle.options(stream=True), self._on_batch, self._on_channel_error)
        self._waiting: dict[str, asyncio.Queue] = {}  # request id -> its outputs (or an exception)
        self._background: set[asyncio.Task] = set()
        self.replica_counts: dict[str, int] = {}  # requests ended per replica (tests, debugging)

    def validate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Length / vocabulary checks the engine would do, before anything is sent."""
        self.inputs.make_requests(request_id, prompt_ids, params)

    async def generate(self, request_id: str, prompt_text: str | None, prompt_ids: list[int],
                       params: SamplingParams, arrival_wall: float | None = None,
                       priority: int = 0, stream: bool = True) -> AsyncIterator[RequestOutput]:
        """RequestOutputs of one request. `stream=False`: the caller only wants the end, so the
        replica may hand over several steps at once (`nonstream_batch_interval_s`)."""
        self.queue.admit(request_id)  # OverloadedError (429) before any work
        submit = replica = None
        added = done = False
        try:
            self.validate(request_id, prompt_ids, params)
            children = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
            self.outputs.add_request(request_id, prompt_text, prompt_ids, params, children)
            added = True
            # Registered before submitting: the channel may bring outputs before the reply.
            outputs = self._waiting[request_id] = asyncio.Queue()
            # Outside the caller's Serve request context, as every call below: Serve cancels a
            # request's calls when it is cancelled, and then `abort` must still get through.
            submit = asyncio.ensure_future(contextvars.Context().run(
                self.handle.submit.remote, request_id, prompt_ids, params, self.channels.router_id,
                arrival_wall=arrival_wall or time.time(), priority=priority,
                batch_interval_s=0.0 if stream else self.nonstream_batch_interval_s))
            replica = await asyncio.shield(submit)  # 429 from the replica, engine dead, ...
            self.channels.attach(replica, request_id)
            first = True
            while not done:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                if first:
                    self.queue.started(request_id)
                    first = False
                done = out.finished
                yield out
        finally:
            self.queue.done(request_id)
            self._waiting.pop(request_id, None)
            if submit is not None:
                local_load.done(request_id)
            if added and not done:
                self.outputs.abort_request(request_id)
            if replica is not None:
                # Counted when it ends (tests read "requests that ended on a replica" from it).
                self.replica_counts[replica] = self.replica_counts.get(replica, 0) + 1
                self.channels.detach(replica, request_id)
                if not done:  # the caller went away: end it in the engine
                    self._spawn(self._control("abort", request_id, replica))
            elif submit is not None and not (submit.done() and (submit.cancelled() or submit.exception())):
                # Left while `submit` was in flight (or as it returned): abort where it lands.
                self._spawn(self._abort_when_submitted(submit, request_id))

    # --- the output channels ----------------------------------------------------------------

    def _on_batch(self, replica: str, items: list) -> None:
        """One channel message: every output of one engine step for this router's requests."""
        core = []
        for item in items:
            if type(item) is tuple:  # (request id, exception): that request failed
                self._deliver(replica, item[0], item[1])
            else:
                core.append(item)
        if not core:
            return
        request_outputs, stop_ids = self.outputs.process_outputs(core)
        if stop_ids:
            self._spawn(self._control("finish", stop_ids, replica))
        for out in request_outputs:
            self._deliver(replica, out.request_id, out)

    def _deliver(self, replica: str, request_id: str, item) -> None:
        q = self._waiting.get(request_id)
        if q is not None:
            q.put_nowait(item)
        if isinstance(item, BaseException) or item.finished:
            self.channels.detach(replica, request_id)  # nothing more will come for it

    def _on_channel_error(self, replica: str, request_ids: list[str], error: BaseException) -> None:
        for rid in request_ids:
            q = self._waiting.get(rid)
            if q is not None:
                q.put_nowait(error)

    # --- control calls ----------------------------------------------------------------------

    async def _control(self, method: str, arg, replica: str) -> None:
        try:
            await asyncio.wait_for(getattr(self.handle, method).remote(arg, replica_id=replica),
                                   self.control_timeout_s)
        except Exception as e:  # noqa: BLE001 - the request ends anyway when its tokens run out
            log.warning("%s(%s) on replica %s failed: %s", method, arg, replica, e)

    async def _abort_when_submitted(self, submit, request_id: str) -> None:
        """The caller left while `submit` was in flight: abort wherever it landed."""
        try:
            replica = await submit
        except Exception:  # noqa: BLE001 - never started
            return
        await self._control("abort", request_id, replica)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
