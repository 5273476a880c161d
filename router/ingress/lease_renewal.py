"""The ingress's side of router leases (router/replica/router_leases.py): every
engine replica this ingress has requests on hears from it every third of a lease. A replica that
has not heard from an ingress for a whole lease takes it for dead and aborts its requests, so a
killed router's requests stop holding KV blocks and batch slots. (The output channel cannot tell:
Ray keeps a streaming call's generator running after its caller dies.)"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from router.ingress.periodic import Periodic

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from router.ingress.output_reader import OutputReader

log = logging.getLogger(__name__)


class LeaseRenewal(Periodic):
    def __init__(self, handle: DeploymentHandle, channels: OutputReader, lease_s: float) -> None:
        super().__init__()
        self.handle, self.channels, self.every_s = handle, channels, lease_s / 3

    async def tick(self) -> None:
        replicas = list(self.channels.active)
        if replicas:
            await asyncio.gather(*(self._renew(r) for r in replicas))

    async def _renew(self, replica: str) -> None:
        try:
            call = self.handle.renew_lease.remote(self.channels.ingress_id, replica_id=replica)
            await asyncio.wait_for(call, self.every_s)
        except Exception as e:  # noqa: BLE001 - a gone replica fails its requests elsewhere
            log.debug("lease renewal on replica %s failed: %s", replica, e)
