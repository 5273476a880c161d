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

`known_replicas(app, deployment)` lists the replicas a router in this process knows, so the
router can fan out stats and health checks.
"""
from __future__ import annotations

import importlib
import random
import threading
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

_ROUTERS: dict[tuple[str, str], "LeastLoadedRouter"] = {}


class LocalLoad:
    """Requests this process runs on each engine replica: +1 when Serve routes a `submit`
    (`on_request_routed`, in Serve's routing loop), -1 when the router ends the request."""

    def __init__(self):
        self._lock = threading.Lock()  # Serve's routing loop may run on its own thread
        self._replica_of: dict[str, str] = {}
        self._ended: set[str] = set()  # ended before their routing was reported
        self.counts: dict[str, int] = {}

    def routed(self, request_id: str, replica: str) -> None:
        with self._lock:
            if request_id in self._ended:
                self._ended.discard(request_id)
                return
            self._replica_of[request_id] = replica
            self.counts[replica] = self.counts.get(replica, 0) + 1

    def done(self, request_id: str) -> None:
        with self._lock:
            replica = self._replica_of.pop(request_id, None)
            if replica is None:
                if len(self._ended) > 10_000:  # routing never reported (call failed): forget
                    self._ended.clear()
                self._ended.add(request_id)
            else:
                self.counts[replica] -= 1

    def get(self, replica: str) -> int | None:
        return self.counts.get(replica)


local_load = LocalLoad()


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
        registry = _module()._ROUTERS
        registry[(did.app_name, did.name)] = self
        super().update_replicas(replicas)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        target = pending_request.kwargs.get("replica_id") if pending_request is not None else None
        if target:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        cache = self.replica_queue_len_cache
        local = _module().local_load

        def inflight(r: RunningReplica) -> int | None:
            calls, running = cache.get(r.replica_id), local.get(r.replica_id.unique_id)
            return None if calls is None and running is None else (calls or 0) + (running or 0)

        scored = sorted(candidate_replicas,
                        key=lambda r: (replica_load(inflight(r), r.routing_stats or {}), random.random()))
        return [[r] for r in scored]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        if pending_request.metadata.call_method == "submit" and pending_request.args:
            _module().local_load.routed(pending_request.args[0], replica_id.unique_id)


def _module():
    """This module as the rest of the process imports it (Serve may ship the router class by
    value, with its own copy of the module globals)."""
    return importlib.import_module("router.replica_choice")
