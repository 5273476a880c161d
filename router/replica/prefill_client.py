"""Disaggregated serving in the engine replicas: the decode side asks the prefill pool for the
KV of long prompts (`RemotePrefills`), the prefill side computes it and hands it over
(`prefill_kv`). The engine decides which requests go remote (engine/kv_transfer/); the KV moves
through Ray's object store (router/replica/kv_transport.py).

A load that fails for any reason (the prefill replica died, the transfer broke, the payload
does not fit, the timeout passed) is recomputed by the decode replica (policy `recompute`) or
ends the request with a clear error (policy `fail`): never a hung stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Callable, Iterable

import router.tracing as tracing
from engine.errors import EngineDeadError, InvalidRequestError
from engine.kv_transfer.awaiting_kv import KVLoadRequest
from engine.sampling_params import SamplingParams
from router.messages import PrefillKV, PrefillKVDone
from router.metrics import KV_TRANSFER_COUNTERS
from router.replica.kv_transport import receive_kv, send_kv

if TYPE_CHECKING:
    from opentelemetry.trace import Span
    from ray.serve.handle import DeploymentHandle

    from engine.async_engine import AsyncEngine
    from router.histogram import Histogram

log = logging.getLogger(__name__)

FAILURE_POLICIES = ("recompute", "fail")


class RemotePrefills:
    """Decode replica: performs the engine's remote prefills, one task per sequence."""

    def __init__(
        self,
        engine: AsyncEngine,
        prefill: DeploymentHandle,
        hist: dict[str, Histogram],
        policy: str = "recompute",
        timeout_s: float = 60.0,
        span_of: Callable[[str], Span | None] = lambda sequence_id: None,
    ) -> None:
        """`span_of`: a sequence's request span (router/tracing.py; None: not traced)."""
        if policy not in FAILURE_POLICIES:
            raise InvalidRequestError(f"kv_transfer_failure must be one of {FAILURE_POLICIES}, got {policy!r}")
        self.engine, self.prefill, self.hist = engine, prefill, hist
        self.policy, self.timeout_s = policy, timeout_s
        self.span_of = span_of
        self.layout = engine.kv_layout
        self.loop: asyncio.AbstractEventLoop | None = None  # set by the replica's first request
        self.tasks: dict[str, asyncio.Task] = {}  # sequence id -> its load
        self.counters = {k: 0 for k in KV_TRANSFER_COUNTERS if k.startswith("kv_transfer")}

    def start(self, loads: list[KVLoadRequest]) -> None:
        """From the engine's step thread (the replica hands over the loads without a source)."""
        loop = self.loop
        if loop is None:  # no request came through this replica's loop yet: prefill here
            for load in loads:
                self.engine.kv_load_failed(load.request_id)
            return
        loop.call_soon_threadsafe(self._start, loads)

    def _start(self, loads: list[KVLoadRequest]) -> None:
        for load in loads:
            self.tasks[load.request_id] = asyncio.get_running_loop().create_task(self._load(load))

    def cancel(self, sequence_ids: Iterable[str]) -> None:
        """The request ended here (abort, disconnect): stop waiting for its KV."""
        for sid in sequence_ids:
            task = self.tasks.pop(sid, None)
            if task is not None:
                task.cancel()

    async def _load(self, load: KVLoadRequest) -> None:
        t0 = time.monotonic()
        transfer = None
        span = parent = self.span_of(load.request_id)  # None: not traced
        if parent is not None:
            attributes = tracing.attributes_of(
                sequence_id=load.request_id, prompt_tokens=len(load.prompt_token_ids), first_block=load.first_block
            )
            span = tracing.start_span("orbital.remote_prefill", parent, attributes)
        try:
            msg = PrefillKV(
                load.request_id,
                load.prompt_token_ids,
                load.first_block,
                self.layout,
                load.lora_request,
                traceparent=tracing.traceparent(span),
            )
            async with asyncio.timeout(self.timeout_s):
                done: PrefillKVDone = await self.prefill.prefill_kv.remote(msg)
                t1 = time.monotonic()
                if span is not None:
                    span.set_attributes(
                        tracing.attributes_of(prefill_replica=done.replica_id, compute_s=done.compute_s)
                    )
                    transfer = tracing.start_span("orbital.kv_transfer", span)
                blocks = await receive_kv(done.handle)
            # Not redundant with the engine's check in load_kv: here a payload that does not fit
            # is a failed transfer (the policy below, kv_transfer_failures); there, on the step
            # thread, it can only be recomputed and this would have counted a transfer. The
            # prefill side checks the layout alone.
            blocks.check(self.layout, load.num_blocks)
            self.engine.load_kv(load.request_id, blocks)
            t2 = time.monotonic()
            self.counters["kv_transfers"] += 1
            self.counters["kv_transfer_blocks"] += blocks.num_blocks
            self.counters["kv_transfer_bytes"] += blocks.nbytes
            self.hist["kv_transfer_seconds"].observe(t2 - t1)
            self.hist["remote_prefill_seconds"].observe(t2 - t0)
            tracing.end(transfer, tracing.attributes_of(blocks=blocks.num_blocks, bytes=blocks.nbytes))
            tracing.end(span)
        except asyncio.CancelledError:
            tracing.end(transfer, error="cancelled: the request ended")
            tracing.end(span, error="cancelled: the request ended")
            raise  # the request ended here; the engine already dropped it
        except Exception as e:  # noqa: BLE001 - any failure: recompute or fail, never hang
            self.counters["kv_transfer_failures"] += 1
            tracing.end(transfer, error=e)
            tracing.end(span, tracing.attributes_of(failure_policy=self.policy), error=e)
            reason = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            log.warning("remote prefill of %s failed (%s); policy %s", load.request_id, reason, self.policy)
            self.engine.kv_load_failed(
                load.request_id, None if self.policy == "recompute" else f"remote prefill failed: {reason}"
            )
        finally:
            if self.tasks.get(load.request_id) is asyncio.current_task():
                del self.tasks[load.request_id]


async def prefill_kv(engine: AsyncEngine, msg: PrefillKV, replica_id: str) -> PrefillKVDone:
    """Prefill replica: compute `msg.prompt_token_ids` (its own prefix cache may hold some of
    them), read out their KV from `msg.first_block` on, and put it in the object store."""
    t0 = time.monotonic()
    span = None
    if msg.traceparent is not None:
        attributes = tracing.attributes_of(
            sequence_id=msg.request_id, replica=replica_id, prompt_tokens=len(msg.prompt_token_ids)
        )
        span = tracing.start_span("orbital.prefill", msg.traceparent, attributes)
    try:
        done = await _prefill_kv(engine, msg, replica_id, t0)
    except BaseException as e:
        tracing.end(span, error=e)
        raise
    tracing.end(span, tracing.attributes_of(compute_s=done.compute_s))
    return done


async def _prefill_kv(engine: AsyncEngine, msg: PrefillKV, replica_id: str, t0: float) -> PrefillKVDone:
    engine.kv_layout.check_matches(msg.layout)
    rid = f"{msg.request_id}@prefill-{uuid.uuid4().hex[:8]}"
    blocks = None
    # One greedy token, discarded: the decode replica samples the first token itself.
    async for out in engine.generate_tokens(
        rid,
        msg.prompt_token_ids,
        SamplingParams(temperature=0.0, max_tokens=1),
        kv_export_first_block=msg.first_block,
        lora_request=msg.lora_request,
    ):
        if out.error:
            raise EngineDeadError(f"prefill of {msg.request_id} failed: {out.error}")
        if out.kv_blocks is not None:
            blocks = out.kv_blocks
    if blocks is None:
        raise EngineDeadError(f"prefill of {msg.request_id} ended without its KV")
    return PrefillKVDone(send_kv(blocks), replica_id, time.monotonic() - t0)
