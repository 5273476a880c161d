"""Which engine replica gets a request: Serve's RequestRouter, with the policy of `AppConfig.routing`.

Runs in the caller (the router's ingress replica), on every handle call to the engine
deployment:
  * a call with `replica_id=<unique id>` in its kwargs is pinned to that replica: the router's
    `finish` (stop string matched), `stats` and health checks must reach the replica that
    holds the request, or every replica in turn;
  * otherwise (`submit`) the policy ranks the replicas and Serve sends to the first ranked
    replica that has room (`max_ongoing_requests`):
      - least-loaded: requests this caller runs there (`local_load`: counted from the routed
        `submit` until the router ends the request, plus Serve's own count of this caller's
        calls in flight), plus the replica's waiting queue and KV usage as published by
        `record_routing_stats()` (covers other callers);
      - round-robin: in turn;
      - cache-aware: see `cache_aware.py`.

`registry.known_replicas(app, deployment)` lists the replicas a router in this process knows,
so the ingress can fan out stats and health checks; `local_load` counts its running requests.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

# Module objects, not names from them: Serve may ship this class by value (cloudpickle), and a
# module reference is pickled by name, so the shipped class shares these with the process.
import router.replica_choice.least_loaded as least_loaded
import router.replica_choice.local_load as local_load_module
import router.replica_choice.registry as registry

POLICIES = ("cache-aware", "least-loaded", "round-robin")


class ReplicaChoice(FIFOMixin, RequestRouter):
    replicas: list[RunningReplica] = []
    policy = "least-loaded"
    block_size = 16

    def initialize_state(self, policy: str = "least-loaded", block_size: int = 16, **_: Any) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        self.policy, self.block_size = policy, block_size
        self._turn = itertools.count()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        self.replicas = list(replicas)
        did = self._deployment_id
        registry.register(did.app_name, did.name, self)
        super().update_replicas(replicas)

    def inflight(self, r: RunningReplica) -> int | None:
        calls = self.replica_queue_len_cache.get(r.replica_id)
        running = local_load_module.local_load.get(r.replica_id.unique_id)
        return None if calls is None and running is None else (calls or 0) + (running or 0)

    def load(self, r: RunningReplica) -> float:
        return least_loaded.replica_load(self.inflight(r), r.routing_stats or {})

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        target = pending_request.kwargs.get("replica_id") if pending_request is not None else None
        if target:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        if self.policy == "round-robin" and candidate_replicas:
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            k = next(self._turn) % len(ordered)
            return [[r] for r in ordered[k:] + ordered[:k]]
        scored = sorted(candidate_replicas, key=lambda r: (self.load(r), random.random()))
        return [[r] for r in scored]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        if pending_request.metadata.call_method == "submit" and pending_request.args:
            local_load_module.local_load.routed(pending_request.args[0].request_id, replica_id.unique_id)
