"""The text side of one request, in the router: token ids go to an engine replica, token ids come
back, and the engine's OutputProcessor turns them into RequestOutputs (incremental text, stop
strings, n>1 aggregation) here.

A stop string is found here, not in the engine: the router calls the replica's `finish` for
those sequences (pinned to the replica that holds them) so their KV blocks are freed at once.
When the caller stops reading (client gone, timeout, error), the replica call is cancelled,
which aborts the request in the engine before its next step.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator

from engine.input_processor import InputProcessor
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from router.backpressure import RouterQueue

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
        self.stream_handle = handle.options(stream=True)
        self.tokenizer = tokenizer
        self.inputs = inputs
        self.outputs = OutputProcessor(tokenizer)
        self.control_timeout_s = control_timeout_s
        self._background: set[asyncio.Task] = set()
        self.replica_counts: dict[str, int] = {}  # requests sent per replica (tests, debugging)

    def validate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Length / vocabulary checks the engine would do, before anything is sent."""
        self.inputs.make_requests(request_id, prompt_ids, params)

    async def generate(self, request_id: str, prompt_text: str | None, prompt_ids: list[int],
                       params: SamplingParams, arrival_wall: float | None = None,
                       priority: int = 0, stream: bool = True) -> AsyncIterator[RequestOutput]:
        """RequestOutputs of one request. `stream=False`: the caller only wants the end, so the
        replica may send several steps per message (`nonstream_batch_interval_s`)."""
        self.queue.admit(request_id)  # OverloadedError (429) before any work
        gen = replica = None
        added = text_done = engine_done = False
        finished_here: list[str] = []  # children the router ended (stop strings)
        try:
            self.validate(request_id, prompt_ids, params)
            children = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
            self.outputs.add_request(request_id, prompt_text, prompt_ids, params, children)
            added = True
            gen = self.stream_handle.generate_tokens.remote(
                request_id, prompt_ids, params, arrival_wall=arrival_wall or time.time(), priority=priority,
                batch_interval_s=0.0 if stream else self.nonstream_batch_interval_s)
            async for replica, core_outputs in gen:
                self.queue.started(request_id)
                request_outputs, stop_ids = self.outputs.process_outputs(core_outputs)
                if stop_ids:
                    finished_here.extend(stop_ids)
                    if not any(o.finished for o in request_outputs):  # others still generate
                        self._spawn(self._finish(stop_ids, replica))
                for out in request_outputs:
                    text_done = text_done or out.finished
                    yield out
                if text_done:
                    break
            else:
                engine_done = True
        finally:
            self.queue.done(request_id)
            if replica is not None:
                self.replica_counts[replica] = self.replica_counts.get(replica, 0) + 1
            if added and not text_done:
                self.outputs.abort_request(request_id)
            if gen is not None and not engine_done and (not text_done or finished_here):
                # The engine side is still open: a stop string ended it here, or the caller
                # went away. Finish first (frees KV as "stopped"), then end the stream.
                self._spawn(self._close(gen, finished_here if text_done else [], replica))

    async def _finish(self, child_ids: list[str], replica: str | None) -> None:
        if replica is None:
            return
        try:
            await asyncio.wait_for(self.handle.finish.remote(child_ids, replica_id=replica),
                                   self.control_timeout_s)
        except Exception as e:  # noqa: BLE001 - the stream's cancel still frees the blocks
            log.warning("finish(%s) on replica %s failed: %s", child_ids, replica, e)

    async def _close(self, gen, stop_ids: list[str], replica: str | None) -> None:
        if stop_ids:
            await self._finish(stop_ids, replica)
        gen.cancel()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

