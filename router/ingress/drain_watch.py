"""Drain on scale-down and redeploy, seen from the ingress.

Serve removes a replica it stops (scale-down, redeploy, a smaller `num_replicas`) from the
routers' lists at once, so it takes no new requests; it then waits for the replica's open calls
(its output channels) for `graceful_shutdown_timeout_s` before killing it. The engine
deployment's setting is `AppConfig.drain_timeout_s` plus a margin (`router/app.py`).

This watch gives a removed replica's requests `drain_timeout_s` to finish where they run; the
ones still running then move to another replica (`failover.py`), well before Serve's kill. A
replica killed outright needs no watch: its output channel fails and its requests move at once.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from router.ingress.periodic import Periodic
from router.replica_choice.routing_state import routing_state

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from router.ingress.output_reader import OutputReader

log = logging.getLogger(__name__)

CHECK_S = 0.5  # how often replicas with requests here are looked up in the router's list


class DrainWatch(Periodic):
    every_s = CHECK_S

    def __init__(
        self,
        handle: DeploymentHandle,
        channels: OutputReader,
        budget_s: float,
        on_drained: Callable[[str, list[str]], None],
    ) -> None:
        self.handle, self.channels, self.budget_s, self.on_drained = handle, channels, budget_s, on_drained
        super().__init__()
        self.unlisted_since: dict[str, float] = {}  # replica -> when it left the router's list

    async def tick(self) -> None:
        self.check(time.monotonic())

    def check(self, now: float) -> None:
        active = self.channels.active
        for r in [r for r in self.unlisted_since if r not in active]:
            del self.unlisted_since[r]  # nothing of ours left there
        if not active:
            return
        listed = {r for r, _ in routing_state().known_replicas(self.handle.app_name, self.handle.deployment_name)}
        if not listed:
            return  # the router has no list yet
        for replica in list(active):
            if replica in listed:
                self.unlisted_since.pop(replica, None)
                continue
            since = self.unlisted_since.setdefault(replica, now)
            if since == now:
                log.info("engine replica %s is being removed: %d requests drain", replica, len(active[replica]))
            if now - since >= self.budget_s:
                ids = list(active.get(replica, ()))
                del self.unlisted_since[replica]
                log.warning("drain budget over on engine replica %s: %d requests move", replica, len(ids))
                self.on_drained(replica, ids)
