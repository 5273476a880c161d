"""A replica's prefix-cache KV events for the ingresses' cache-aware routing.

The engine thread publishes an event batch after each step that changed the cached hashes; the
feed queues it on the replica's event loop, ahead of that step's outputs, and hands it to (1)
the output channel of every ingress with requests running here and (2) the open `kv_events`
streams, which the ingresses call again and again (router/ingress/kv_subscriber.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable, Iterable

from engine.core.kv_events import KVEventBatch, KVEventLog
from router.messages import KVEventsUpdate, encode
from router.replica.outbox import Outbox

# A `kv_events` call ends after this long: Serve's graceful drain waits for open calls, and the
# ingress calls again at once.
KV_FEED_S = 2.0


class KVFeed:
    def __init__(self, kv_log: KVEventLog, outboxes: Callable[[], Iterable[Outbox]]) -> None:
        """`outboxes`: the replica's current output-channel outboxes (read on the loop)."""
        self.kv_log = kv_log
        self._outboxes = outboxes
        self.loop: asyncio.AbstractEventLoop | None = None  # the replica's; set by its first call
        self._waiters: set[asyncio.Event] = set()
        kv_log.add_listener(self._published)

    def _published(self, batch: KVEventBatch) -> None:
        """Engine thread, after each step that changed the cached hashes: queued on the loop
        ahead of that step's outputs (call_soon_threadsafe keeps the order)."""
        loop = self.loop
        if loop is not None:
            loop.call_soon_threadsafe(self._to_ingresses, batch)

    def _to_ingresses(self, batch: KVEventBatch) -> None:
        for box in self._outboxes():
            if box.active:
                box.kv(batch)
        for ev in self._waiters:
            ev.set()

    async def stream(self, epoch: str | None, seq: int) -> AsyncIterator[bytes]:
        """One KVEventsUpdate at once (a snapshot when the batches after `seq` of `epoch` are
        gone), then one per step that changes the cached hashes, for KV_FEED_S."""
        self.loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        self._waiters.add(wake)
        try:
            deadline = time.monotonic() + KV_FEED_S
            first = True
            while True:
                batches = self.kv_log.since(epoch, seq) if epoch is not None else None
                snap = None
                if batches is None:
                    snap, batches = self.kv_log.snapshot(), []
                    epoch, seq = snap.epoch, snap.seq
                if batches:
                    seq = batches[-1].seq
                if snap is not None or batches or first:
                    yield encode(KVEventsUpdate(snap, batches))
                first = False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), remaining)
                except asyncio.TimeoutError:
                    return
        finally:
            self._waiters.discard(wake)
