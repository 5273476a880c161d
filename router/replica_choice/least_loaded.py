"""Which engine replica gets a request: Serve's RequestRouter, least loaded first.

Runs in the caller (the router's ingress replica), on every handle call to the engine
deployment:
  * a call with `replica_id=<unique id>` in its kwargs is pinned to that replica: the router's
    `finish` (stop string matched), `stats` and health checks must reach the replica that
    holds the request, or every replica in turn;
  * otherwise replicas are ranked by load: requests this caller runs there (`local_load`:
    counted from the routed `submit` until the router ends the request, since a request is
    no longer one long Serve call; plus Serve's own count of this caller's calls in flight),
    plus the replica's own waiting queue and KV usage as published by
    `record_routing_stats()` (covers other callers). Serve then sends to the first ranked
    replica that has room (`max_ongoing_requests`).
The cache-aware (prefix-hash) policy will replace the ranking; pinning stays.

`registry.known_replicas(app, deployment)` lists the replicas a router in this process knows,
so the ingress can fan out stats and health checks; `local_load` counts its running requests.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

# Module objects, not names from them: Serve may ship this class by value (cloudpickle), and a
# module reference is pickled by name, so the shipped class shares these with the process.
import router.replica_choice.local_load as local_load_module
import router.replica_choice.registry as registry


def replica_load(queue_len: int | None, routing_stats: dict[str, Any]) -> float:
    """Lower is better. In-flight requests dominate; waiting and KV usage break ties."""
    inflight = queue_len if queue_len is not None else routing_stats.get("in_flight", 0)
    return inflight + 0.5 * routing_stats.get("num_waiting", 0) + routing_stats.get("kv_usage", 0.0)


class LeastLoadedChoice(FIFOMixin, RequestRouter):
    replicas: list[RunningReplica] = []

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        self.replicas = list(replicas)
        did = self._deployment_id
        registry.register(did.app_name, did.name, self)
        super().update_replicas(replicas)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        target = pending_request.kwargs.get("replica_id") if pending_request is not None else None
        if target:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        cache = self.replica_queue_len_cache
        local = local_load_module.local_load

        def inflight(r: RunningReplica) -> int | None:
            calls, running = cache.get(r.replica_id), local.get(r.replica_id.unique_id)
            return None if calls is None and running is None else (calls or 0) + (running or 0)

        scored = sorted(
            candidate_replicas, key=lambda r: (replica_load(inflight(r), r.routing_stats or {}), random.random())
        )
        return [[r] for r in scored]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        if pending_request.metadata.call_method == "submit" and pending_request.args:
            local_load_module.local_load.routed(pending_request.args[0].request_id, replica_id.unique_id)
