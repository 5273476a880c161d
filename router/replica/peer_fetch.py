"""Fetching a prompt's prefix from the replica that holds it (a peer of the same pool), instead
of recomputing it.

The replica choice sends a request away from the replica holding its prefix when that one is
loaded past the guard, with a `PeerPrefix` hint naming it (router/replica_choice/). The engine
here holds blocks for the hinted tokens and asks for them (a `KVLoadRequest` with a `source`,
engine/kv_transfer/awaiting_kv.py); `PeerFetches` calls the holder's `export_cached_kv` through
this pool's own deployment handle, pinned to it, and writes the answer into the held blocks.
The holder reads its cached blocks out between two steps (`export_cached_kv` below) and puts
them in the object store (kv_transport.py); its blocks are held only while they are read.

Any failure (the holder is gone, its blocks were evicted meanwhile so it answers None, the
payload does not fit, the timeout passed) recomputes here: a fetch never fails a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable, Iterable

import router.tracing as tracing
from engine.kv_transfer.awaiting_kv import KVLoadRequest
from router.messages import ExportCachedKV
from router.metrics import KV_PEER_COUNTERS
from router.replica.fetch_speed import FetchSpeed
from router.replica.kv_transport import KVHandle, receive_kv, send_kv

if TYPE_CHECKING:
    from opentelemetry.trace import Span
    from ray.serve.handle import DeploymentHandle

    from engine.async_engine import AsyncEngine
    from router.histogram import Histogram

log = logging.getLogger(__name__)

# A fetch is meant to beat recomputing, which rarely takes longer than this: past it, recompute.
PEER_FETCH_TIMEOUT_S = 10.0


class PeerFetches:
    """Both sides in one replica: fetching (one task per sequence whose engine asked for a peer's
    blocks) and exporting to a peer. `pool`: returns this pool's deployment handle (made on
    first use: a replica cannot make it while Serve constructs it)."""

    def __init__(
        self,
        engine: AsyncEngine,
        pool: Callable[[], DeploymentHandle],
        hist: dict[str, Histogram],
        timeout_s: float = PEER_FETCH_TIMEOUT_S,
        span_of: Callable[[str], Span | None] = lambda sequence_id: None,
    ) -> None:
        """`span_of`: a sequence's request span (router/tracing.py; None: not traced)."""
        self.engine, self.pool, self.hist, self.timeout_s = engine, pool, hist, timeout_s
        self.span_of = span_of
        self.layout = engine.kv_layout
        self.loop: asyncio.AbstractEventLoop | None = None  # set by the replica's first request
        self.tasks: dict[str, asyncio.Task] = {}  # sequence id -> its fetch
        self.speed = FetchSpeed()
        self.counters = {k: 0 for k in KV_PEER_COUNTERS}

    def start(self, loads: list[KVLoadRequest]) -> None:
        """From the engine's step thread: fetch these (each names its source)."""
        loop = self.loop
        if loop is None:  # no request came through this replica's loop yet: recompute
            for load in loads:
                self.engine.kv_load_failed(load.request_id)
            return
        loop.call_soon_threadsafe(self._start, loads)

    def _start(self, loads: list[KVLoadRequest]) -> None:
        for load in loads:
            self.tasks[load.request_id] = asyncio.get_running_loop().create_task(self._fetch(load))

    def cancel(self, sequence_ids: Iterable[str]) -> None:
        """The request ended here (abort, disconnect): stop waiting for its KV."""
        for sid in sequence_ids:
            task = self.tasks.pop(sid, None)
            if task is not None:
                task.cancel()

    async def _fetch(self, load: KVLoadRequest) -> None:
        t0 = time.monotonic()
        span = self.span_of(load.request_id)
        if span is not None:
            attributes = tracing.attributes_of(
                sequence_id=load.request_id, holder=load.source, first_block=load.first_block, blocks=load.num_blocks
            )
            span = tracing.start_span("orbital.peer_fetch", span, attributes)
        msg = ExportCachedKV(
            load.request_id,
            load.prompt_token_ids,
            load.first_block,
            load.num_blocks,
            self.layout,
            load.lora_request,
            load.cache_salt,
        )
        try:
            async with asyncio.timeout(self.timeout_s):
                handle: KVHandle | None = await self.pool().export_cached_kv.remote(msg, replica_id=load.source)
                if handle is None:
                    raise LookupError("the holder no longer caches those blocks")
                t1 = time.monotonic()
                blocks = await receive_kv(handle)
            # A payload that does not fit is a failed fetch (counted here), not a refused load.
            blocks.check(self.layout, load.num_blocks)
            self.engine.load_kv(load.request_id, blocks)
            t2 = time.monotonic()
            self.speed.observe(t1 - t0, blocks.nbytes, t2 - t1)
            self.counters["kv_peer_fetches"] += 1
            self.counters["kv_peer_fetch_bytes"] += blocks.nbytes
            self.counters["kv_peer_tokens_fetched"] += load.num_blocks * self.layout.block_size
            self.hist["kv_peer_fetch_seconds"].observe(t2 - t0)
            tracing.end(span, tracing.attributes_of(bytes=blocks.nbytes))
        except asyncio.CancelledError:
            tracing.end(span, error="cancelled: the request ended")
            raise  # the request ended here; the engine already dropped it
        except Exception as e:  # noqa: BLE001 - any failure: recompute, never hang
            tracing.end(span, error=e)
            self.counters["kv_peer_fetch_failures"] += 1
            reason = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            log.warning("fetch of %s from replica %s failed (%s): recomputing", load.request_id, load.source, reason)
            self.engine.kv_load_failed(load.request_id)
        finally:
            if self.tasks.get(load.request_id) is asyncio.current_task():
                del self.tasks[load.request_id]

    async def export(self, msg: ExportCachedKV) -> KVHandle | None:
        """The holding side: the cached blocks a peer asked for, in the object store (None: not
        all of them are cached here any more)."""
        self.engine.kv_layout.check_matches(msg.layout)
        blocks = await self.engine.export_cached_kv(
            msg.prompt_token_ids, msg.first_block, msg.num_blocks, msg.lora_request, msg.cache_salt
        )
        if blocks is None:
            return None
        self.counters["kv_peer_exports"] += 1
        return send_kv(blocks)
