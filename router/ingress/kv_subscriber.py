"""The ingress side of the KV event feed: keeps `kv_index` current for every engine replica the
cache-aware router knows (router/replica_choice/kv_index.py).

One follower task per replica calls the replica's `kv_events(epoch, seq)` (a streaming call
pinned to it, which ends after a few seconds) again and again: the first answer is a snapshot
(a new router, a restarted engine, a gap), later ones the batches since the last seen. A replica
that leaves the router's list, or whose feed fails, leaves the index; a router restarted mid-
traffic rebuilds its index from the snapshots.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import TYPE_CHECKING

from router.messages import KVEventsUpdate, decode
from router.replica_choice.routing_state import routing_state

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

log = logging.getLogger(__name__)

CHECK_S = 0.5  # how often the replica list is compared with the followers
FIRST_MESSAGE_S = 10.0  # a feed call that brings nothing this long: the replica is gone or stuck


class KVSubscriber:
    def __init__(self, handle: DeploymentHandle) -> None:
        self.control = handle
        self.handle = handle.options(stream=True)
        self._followers: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Idempotent. Called where the ingress starts (when its loop runs) and with each request."""
        if self._task is None or self._task.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # no loop yet: the first request starts it
            self._task = loop.create_task(self._watch(), context=contextvars.Context())

    def _cache_aware(self) -> bool:
        r = routing_state().router(self.handle.app_name, self.handle.deployment_name)
        return r is not None and getattr(r, "policy", None) == "cache-aware"

    async def _watch(self) -> None:
        try:  # the handle's router (and its replica list) starts with the first call
            await asyncio.wait_for(self.control.check_health.remote(), FIRST_MESSAGE_S)
        except Exception:  # noqa: BLE001 - no replica yet: the list fills in later
            pass
        while True:
            known = set()
            if self._cache_aware():
                known = {
                    rid for rid, _ in routing_state().known_replicas(self.handle.app_name, self.handle.deployment_name)
                }
            for rid in known - set(self._followers):
                self._followers[rid] = asyncio.get_running_loop().create_task(
                    self._follow(rid), context=contextvars.Context()
                )
            for rid in set(self._followers) - known:
                self._followers.pop(rid).cancel()
                routing_state().kv_index.drop(rid)
            await asyncio.sleep(CHECK_S)

    async def _follow(self, replica: str) -> None:
        while True:
            epoch, seq, needs_snapshot = routing_state().kv_index.position(replica)
            call = self.handle.kv_events.remote(None if needs_snapshot else epoch, seq, replica_id=replica)
            try:
                it = call.__aiter__()
                first = await asyncio.wait_for(it.__anext__(), FIRST_MESSAGE_S)
                self._apply(replica, first)
                async for payload in it:
                    self._apply(replica, payload)
            except asyncio.CancelledError:
                raise
            except StopAsyncIteration:
                pass
            except Exception as e:  # noqa: BLE001 - dead or stuck replica: forget what it held
                log.warning("KV event feed of replica %s failed: %s", replica, e)
                routing_state().kv_index.drop(replica)
                try:
                    call.cancel()
                except Exception:  # noqa: BLE001 - already over
                    pass
                await asyncio.sleep(1.0)

    @staticmethod
    def _apply(replica: str, payload: bytes) -> None:
        msg = decode(payload, KVEventsUpdate)
        if msg.snapshot is not None:
            routing_state().kv_index.reset(replica, msg.snapshot)
        if msg.batches:
            routing_state().kv_index.apply(replica, msg.batches)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for t in self._followers.values():
            t.cancel()
