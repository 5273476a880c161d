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
      - cache-aware: the replica holding the longest cached prefix of the prompt, within a
        load guard (`cache_aware.py`), from the exact index of the replicas' KV events
        (`kv_index.py`); a routed request's blocks count as held there at once (pending).
    Every decision is recorded in `routing_log` (predicted cached tokens; `/metrics`).

`registry.known_replicas(app, deployment)` lists the replicas a router in this process knows,
so the ingress can fan out stats and health checks; `local_load` counts its running requests.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

# Module objects, not names from them: Serve may ship this class by value (cloudpickle), and a
# module reference is pickled by name, so the shipped class shares these with the process.
import router.replica_choice.cache_aware as cache_aware
import router.replica_choice.kv_index as kv_index_module
import router.replica_choice.least_loaded as least_loaded
import router.replica_choice.local_load as local_load_module
import router.replica_choice.registry as registry
import router.replica_choice.routing_log as routing_log_module
from engine.core.block_hash import prompt_hit_hashes

log = logging.getLogger(__name__)

POLICIES = ("cache-aware", "least-loaded", "round-robin")


class ReplicaChoice(FIFOMixin, RequestRouter):
    replicas: list[RunningReplica] = []
    policy = "least-loaded"
    block_size = 16
    slack = cache_aware.DEFAULT_SLACK

    def initialize_state(
        self, policy: str = "least-loaded", block_size: int = 16, slack: float = cache_aware.DEFAULT_SLACK, **_: Any
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        self.policy, self.block_size, self.slack = policy, block_size, slack
        self._turn = itertools.count()
        # request id -> (prompt hashes, cached blocks per replica), from choose to routed.
        self._seen: dict[str, tuple[list[int], dict[str, int]]] = {}

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
        if not candidate_replicas:
            return []
        if self.policy == "round-robin":
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            k = next(self._turn) % len(ordered)
            return [[r] for r in ordered[k:] + ordered[:k]]
        if self.policy == "cache-aware" and pending_request is not None and pending_request.args:
            return self._cache_aware(candidate_replicas, pending_request.args[0])
        scored = sorted(candidate_replicas, key=lambda r: (self.load(r), random.random()))
        return [[r] for r in scored]

    def _cache_aware(self, candidates: list[RunningReplica], msg: Any) -> list[list[RunningReplica]]:
        t0 = time.perf_counter()
        seen = self._seen.get(msg.request_id)
        if seen is None:
            if len(self._seen) > 4096:  # requests that were never routed (cancelled, refused)
                self._seen.clear()
            no_hits = msg.params.prompt_logprobs is not None  # the engine looks nothing up then
            hashes = [] if no_hits else prompt_hit_hashes(msg.prompt_token_ids, self.block_size)
            seen = self._seen[msg.request_id] = (hashes, {})
        hashes, hits = seen
        index = kv_index_module.kv_index

        def cached(r: RunningReplica) -> int:
            rid = r.replica_id.unique_id
            return max(index.cached_blocks(rid, hashes), index.pending_blocks(rid, hashes)) if hashes else 0

        ranked, found = cache_aware.rank(candidates, self.load, cached, self.slack)
        hits.update((r.replica_id.unique_id, n) for r, n in found.items())
        routing_log_module.routing_log.timed(time.perf_counter() - t0)
        return [[r] for r in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        if pending_request.metadata.call_method != "submit" or not pending_request.args:
            return
        msg, replica = pending_request.args[0], replica_id.unique_id
        local_load_module.local_load.routed(msg.request_id, replica)
        hashes, hits = self._seen.pop(msg.request_id, ([], {}))
        predicted = hits.get(replica, 0) * self.block_size
        kv_index_module.kv_index.add_pending(msg.request_id, replica, hashes)
        routing_log_module.routing_log.routed(msg.request_id, replica, self.policy, predicted)
        log.debug(
            "request %s -> replica %s (%s, predicted cached tokens %d)", msg.request_id, replica, self.policy, predicted
        )
