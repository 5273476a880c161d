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
        When the guard passed over a replica holding more of the prefix than the chosen one,
        the chosen one may fetch it from that one instead of recomputing it
        (`peer_fetch_plan.py`): the `submit` message then carries a `PeerPrefix` hint.
        A LoRA request's prefix is hashed under its adapter's root, and between equal hits a
        replica holding the adapter goes first (its published `lora_loaded`, or one this
        router sent the adapter to within ADAPTER_SENT_S).
    The first-ranked replica counts the request at once (`RoutingState.tentative`); the
    ingress confirms where it runs when `submit` answers (`RoutingState.confirmed`). Every
    decision is recorded in the routing log (predicted cached tokens; `/metrics`).

The router registers itself in the process's `routing_state()` (routing_state.py), through
which the ingress lists the replicas it knows (stats and health fan-out).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

# Module objects, not names from them: Serve may ship this class by value (cloudpickle), and a
# module reference is pickled by name, so the shipped class shares the process's routing state.
import router.replica_choice.cache_aware as cache_aware
import router.replica_choice.least_loaded as least_loaded
import router.replica_choice.peer_fetch_plan as peer_fetch_plan
import router.replica_choice.routing_state as routing_state_module
from engine.core.block_hash import kv_hash_root, prompt_hit_hashes
from engine.errors import EngineDeadError
from engine.kv_transfer.peer_prefix import PeerPrefix
from engine.lora.request import adapter_hash_root

POLICIES = ("cache-aware", "least-loaded", "round-robin")
# What a block in a replica's offload tier is worth against one in its pool: a load away from a
# hit. Measured (docs/performance.md, bench_kv_offload): a 1,000-token prompt loaded from the disk
# tier came back 7.7x faster than recomputed, so a tier block saves ~87% of a pool hit's work;
# 0.85 keeps a pool hit ahead of a tier hit of the same length.
TIER_WORTH = 0.85
# How long a replica counts as holding an adapter this router sent it, before its own published
# `lora_loaded` (polled by Serve) says so or not.
ADAPTER_SENT_S = 30.0


class ReplicaGoneError(EngineDeadError):
    """A call pinned to a replica this router no longer lists (stopped, drained, replaced)."""


class EngineRequestRouter(FIFOMixin, RequestRouter):
    """FIFOMixin: Serve's default matching pairs a chosen replica with its request by the
    internal request id, which the calls one HTTP request makes share (the /health fan-out's
    pinned calls then all hung). With FIFO, a replica found goes to the oldest pending call that
    may take it (`_fulfill_next_pending_request`: never one pinned to another replica)."""

    replicas: list[RunningReplica] = []
    policy = "least-loaded"
    block_size = 16
    hash_root: int | None = None
    slack = cache_aware.DEFAULT_SLACK
    peer_fetch = "off"

    def initialize_state(
        self,
        policy: str = "least-loaded",
        block_size: int = 16,
        slack: float = cache_aware.DEFAULT_SLACK,
        kv_cache_dtype: str = "auto",
        peer_fetch: str = "off",
        **_: Any,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        if peer_fetch not in peer_fetch_plan.MODES:
            raise ValueError(f"kv_peer_fetch must be one of {peer_fetch_plan.MODES}, got {peer_fetch!r}")
        self.policy, self.block_size, self.slack, self.peer_fetch = policy, block_size, slack, peer_fetch
        self.hash_root = kv_hash_root(kv_cache_dtype)  # the engines' chains start there
        self._turn = itertools.count()
        self._adapter_sent: dict[str, dict[str, float]] = {}  # adapter name -> replica -> when sent

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any = None) -> None:
        """FIFOMixin's order, except that a call pinned to another replica never takes this one
        (FIFOMixin alone hands a replica found for one call to the oldest pending call, pinned
        elsewhere or not: a stop-string `finish`, an output channel or a health check could then
        reach the wrong replica)."""
        rid = replica.replica_id.unique_id
        queue = self._pending_requests_to_fulfill
        while queue and queue[0].future.done():
            queue.popleft()
        for pr in queue:
            target = pr.kwargs.get("replica_id")
            if pr.future.done() or (target and target != rid):
                continue
            self._cancel_routing_task_for_pending_request(pr)
            self._record_queue_wait_time(pr)
            pr.future.set_result(replica)
            self._remove_pending_request_from_indices(pr)
            return

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        self.replicas = list(replicas)
        did = self._deployment_id
        routing_state_module.routing_state().register(did.app_name, did.name, self)
        super().update_replicas(replicas)

    def inflight(self, r: RunningReplica) -> int | None:
        calls = self.replica_queue_len_cache.get(r.replica_id)
        running = routing_state_module.routing_state().local_load.get(r.replica_id.unique_id)
        return None if calls is None and running is None else (calls or 0) + (running or 0)

    def load(self, r: RunningReplica) -> float:
        return least_loaded.replica_load(self.inflight(r), r.routing_stats or {})

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        target = pending_request.kwargs.get("replica_id") if pending_request is not None else None
        if target:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if chosen or pending_request is None:
                return [chosen]
            # Fail now rather than wait for a replica that will not come back. Serve's loop
            # only looks at the request when we return some replicas; it then sees it done.
            if not pending_request.future.done():
                pending_request.future.set_exception(ReplicaGoneError(f"engine replica {target} is gone"))
            return [list(candidate_replicas)] if candidate_replicas else []
        if not candidate_replicas:
            return []
        msg = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if msg is not None and pending_request.metadata.call_method != "submit":
            msg = None  # an unpinned control call (stats): no request to place
        if msg is not None:
            # Never a replica known dead, nor one this request already left (failover): wait for
            # another rather than send it there.
            avoid = routing_state_module.routing_state().unreachable.current() | set(getattr(msg, "avoid_replicas", ()))
            if avoid:
                candidate_replicas = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid]
                if not candidate_replicas:
                    return []
        hashes: list[int] = []
        predicted: dict[str, int] = {}
        peer: PeerPrefix | None = None
        if self.policy == "round-robin":
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            k = next(self._turn) % len(ordered)
            ranked = ordered[k:] + ordered[:k]
        elif self.policy == "cache-aware" and msg is not None:
            t0 = time.thread_time()  # CPU time: the machine may be busy with engines
            ranked, hashes, predicted, peer = self._cache_aware(candidate_replicas, msg)
            routing_state_module.routing_state().log.timed(time.thread_time() - t0)
        else:
            ranked = sorted(candidate_replicas, key=lambda r: (self.load(r), random.random()))
        if msg is not None:
            if peer != getattr(msg, "peer_prefix", None):  # set, or cleared when routed again
                pending_request.args[0] = dataclasses.replace(msg, peer_prefix=peer)
            routing_state_module.routing_state().tentative(
                msg.request_id, ranked[0].replica_id.unique_id, self.policy, hashes, predicted, self.block_size, peer
            )
        return [[r] for r in ranked]

    def _cache_aware(
        self, candidates: list[RunningReplica], msg: Any
    ) -> tuple[list[RunningReplica], list[int], dict[str, int], PeerPrefix | None]:
        no_hits = msg.params.needs_every_prompt_position  # the engine looks nothing up then
        hashes = (
            []
            if no_hits
            else prompt_hit_hashes(
                msg.prompt_token_ids,
                self.block_size,
                msg.params.cache_salt,
                root=adapter_hash_root(self.hash_root, getattr(msg, "lora_request", None)),
            )
        )
        index = routing_state_module.routing_state().kv_index

        blocks: dict[RunningReplica, tuple[int, int]] = {}  # (in the pool or about to be, in the tier)

        def cached(r: RunningReplica) -> float:
            rid = r.replica_id.unique_id
            pool = max(index.cached_blocks(rid, hashes), index.pending_blocks(rid, hashes)) if hashes else 0
            tier = index.tier_blocks(rid, hashes, pool) if hashes else 0
            blocks[r] = (pool, tier)
            return pool + TIER_WORTH * tier

        def held(r: RunningReplica) -> int:
            return index.held_blocks(r.replica_id.unique_id)

        lora = getattr(msg, "lora_request", None)
        sent = self._adapter_sent.setdefault(lora.lora_name, {}) if lora is not None else {}
        now = time.monotonic()

        def warm(r: RunningReplica) -> bool:
            if lora is None:
                return False
            rid = r.replica_id.unique_id
            return now - sent.get(rid, -ADAPTER_SENT_S) < ADAPTER_SENT_S or lora.lora_name in (
                (r.routing_stats or {}).get("lora_loaded") or ()
            )

        ranked, found = cache_aware.rank(candidates, self.load, cached, self.slack, held, warm)
        if lora is not None:
            sent[ranked[0].replica_id.unique_id] = now
        # the engine counts a tier hit as cached tokens too (loaded, not computed)
        predicted = {r.replica_id.unique_id: sum(blocks[r]) * self.block_size for r in found}
        # Against its confirmed blocks: a prefix still pending there (a fetch in flight) is no hit yet.
        first = ranked[0]
        local = (index.cached_blocks(first.replica_id.unique_id, hashes) if hashes else 0) + blocks[first][1]
        peer = self._peer_prefix(first, candidates, hashes, local)
        if peer is not None:  # fetched tokens count as cached there too
            predicted[ranked[0].replica_id.unique_id] = peer.num_tokens
        return ranked, hashes, predicted, peer

    def _peer_prefix(
        self, chosen: RunningReplica, candidates: list[RunningReplica], hashes: list[int], local_blocks: int
    ) -> PeerPrefix | None:
        """The hint for `chosen` (which holds `local_blocks` of the prompt's blocks) to fetch the
        prefix from the replica caching the most of it, when that saves at least
        MIN_EXTRA_BLOCKS and the cost model (or `kv_peer_fetch: always`) says fetch. Only blocks
        the holder reported cached count: pending ones may not be computed yet."""
        if self.peer_fetch == "off" or not hashes:
            return None
        index = routing_state_module.routing_state().kv_index
        best, source = 0, None
        for r in candidates:
            if r is chosen:
                continue
            n = index.cached_blocks(r.replica_id.unique_id, hashes)
            if n > best:
                best, source = n, r
        extra = best - local_blocks
        if source is None or not peer_fetch_plan.should_fetch(
            self.peer_fetch, extra, self.block_size, chosen.routing_stats or {}
        ):
            return None
        return PeerPrefix(source.replica_id.unique_id, best * self.block_size)
