"""The engine replica's side of router leases (`RouterLeases`, a base of the `EngineReplica`
deployment, so the ingress's handle finds `renew_lease` on it). Each router with requests here
renews its lease every third of `router_lease_s` (router/ingress/lease_renewal.py); a router not
heard from for a whole lease, by request or renewal, is taken for dead: its requests are
aborted (their KV blocks return at the next step) and its outbox dropped. The output channel
cannot tell: Ray keeps a streaming call's generator running after its caller dies.

A router can also fall silent while it lives: once Serve removes this replica from the routers'
lists (a scale-down, a redeploy), no call can be pinned here any more, renewals included, while
the replica drains for `drain_timeout_s`. So a lease that runs out is checked first: the router's
own actor (handed over with its output channel) is asked whether it lives, and a router that
answers keeps its requests. Without that check a drain longer than a lease aborted the streams it
was draining and they moved to other replicas, recomputed.
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

# Seconds a router's actor has to answer when its lease ran out (a dead one fails at once).
PROBE_S = 2.0


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
            expired = [(i, box) for i, box in self._outboxes.items() if box.lease_expired(self.router_lease_s, now)]
            lives = await asyncio.gather(
                *(_router_lives(box, min(PROBE_S, self.router_lease_s / 4)) for _, box in expired)
            )
            now = time.monotonic()
            for (ingress_id, box), alive in zip(expired, lives):
                if alive:
                    box.last_seen = now  # it lives but cannot reach this replica: draining
                    continue
                if self._outboxes.get(ingress_id) is not box:
                    continue  # dropped or replaced while the routers were asked
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


async def _router_lives(box: Outbox, timeout_s: float) -> bool:
    """Whether the router that reads `box` answers (its Serve replica actor's built-in
    `__ray_ready__`); False without a handle (its channel never opened), when it died or when
    it does not answer in time."""
    if box.router is None:
        return False
    try:
        await asyncio.wait_for(box.router.__ray_ready__.remote(), timeout_s)
        return True
    except Exception:  # noqa: BLE001 - dead, unreachable or stalled: taken for dead
        return False
