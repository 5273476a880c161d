"""The engine replica's side of router leases (`RouterLeases`, a base of the `EngineReplica`
deployment, so the ingress's handle finds `renew_lease` on it). Each router with requests here
renews its lease every third of `router_lease_s` (router/ingress/lease_renewal.py); a router not
heard from for a whole lease, by request or renewal, is taken for dead: its requests are
aborted (their KV blocks return at the next step) and its outbox dropped. The output channel
cannot tell: Ray keeps a streaming call's generator running after its caller dies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from router.replica.job import Job
    from router.replica.outbox import Outbox

log = logging.getLogger(__name__)


class RouterLeases:
    """Methods over the attributes `EngineReplica.__init__` sets."""

    engine: AsyncEngine
    router_lease_s: float
    lease_expiries: int  # routers taken for dead (stats)
    _jobs: dict[str, Job]
    _outboxes: dict[str, Outbox]

    async def renew_lease(self, ingress_id: str, replica_id: str | None = None) -> None:
        """The router `ingress_id` is alive (router/ingress/lease_renewal.py)."""
        box = self._outboxes.get(ingress_id)
        if box is not None:
            box.last_seen = time.monotonic()

    async def _expire_leases(self) -> None:
        """Every quarter lease: abort the requests of routers gone for a lease (their KV blocks
        return at the next step) and drop their outboxes."""
        while True:
            await asyncio.sleep(self.router_lease_s / 4)
            now = time.monotonic()
            for ingress_id, box in list(self._outboxes.items()):
                if not box.lease_expired(self.router_lease_s, now):
                    continue
                log.warning(
                    "router %s has not been heard from for %.0f s: aborting its %d request(s)",
                    ingress_id,
                    now - box.last_seen,
                    len(box.active),
                )
                self.lease_expiries += 1
                del self._outboxes[ingress_id]
                for rid in list(box.active):
                    job = self._jobs.get(rid)
                    if job is not None and job.task is not None:
                        job.task.cancel()  # its cleanup aborts it in the engine
                    else:
                        self.engine.abort(rid)
