"""Which engine replica gets a request: Serve's RequestRouter, least loaded first.

Runs in the caller (the router's ingress replica), on every handle call to the engine
deployment:
  * a call with `replica_id=<unique id>` in its kwargs is pinned to that replica: the router's
    `finish` (stop string matched), `stats` and health checks must reach the replica that
    holds the request, or every replica in turn;
  * otherwise replicas are ranked by load: requests this caller has in flight there (Serve's
    queue-length cache, exact for this caller), plus the replica's own waiting queue and KV
    usage as published by `record_routing_stats()` (covers other callers). Serve then sends
    to the first ranked replica that has room (`max_ongoing_requests`).
The cache-aware (prefix-hash) policy will replace the ranking; pinning stays.

`known_replicas(app, deployment)` lists the replicas a router in this process knows, so the
router can fan out stats and health checks.
"""
from __future__ import annotations

import importlib
import random
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

_ROUTERS: dict[tuple[str, str], "LeastLoadedRouter"] = {}


def known_replicas(app_name: str, deployment_name: str) -> list[tuple[str, dict[str, Any]]]:
    """(unique replica id, last routing stats) for every replica the local router knows."""
    r = _ROUTERS.get((app_name, deployment_name))
    if r is None:
        return []
    return [(rep.replica_id.unique_id, dict(rep.routing_stats or {})) for rep in r.replicas]


def replica_load(queue_len: int | None, routing_stats: dict[str, Any]) -> float:
    """Lower is better. In-flight requests dominate; waiting and KV usage break ties."""
    inflight = queue_len if queue_len is not None else routing_stats.get("in_flight", 0)
    return inflight + 0.5 * routing_stats.get("num_waiting", 0) + routing_stats.get("kv_usage", 0.0)


class LeastLoadedRouter(FIFOMixin, RequestRouter):
    replicas: list[RunningReplica] = []

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        self.replicas = list(replicas)
        did = self._deployment_id
        # Serve may ship this class by value (cloudpickle), with its own copy of this module's
        # globals: register in the module that the rest of the process imports.
        registry = importlib.import_module("router.replica_choice")._ROUTERS
        registry[(did.app_name, did.name)] = self
        super().update_replicas(replicas)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        target = pending_request.kwargs.get("replica_id") if pending_request is not None else None
        if target:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        cache = self.replica_queue_len_cache
        scored = sorted(
            candidate_replicas,
            key=lambda r: (replica_load(cache.get(r.replica_id), r.routing_stats or {}), random.random()),
        )
        return [[r] for r in scored]
