"""`GET /cluster/state`: the cluster's live state as the web page (`router/ingress/web/`) shows it,
made of what /health and /metrics already ask of the engine replicas. Per pool: each replica the
router knows, whether it answered its health check, its load, KV usage and prefix-cache hits
(its `stats`), and what this router replica routed to it.

The shape is `ClusterState` in router/ingress/response_models.py (documented in /openapi.json);
these functions only reshape numbers the replicas and the router report."""

from __future__ import annotations

from typing import Any

from router.metrics import aggregate

# Engine replica stats (engine/stats.py and the replica's own counters) the page shows.
LOAD_KEYS = (
    "num_running",
    "num_waiting",
    "kv_usage",
    "blocks_used",
    "num_blocks",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_hit_rate",
    "prompt_tokens",
    "generation_tokens",
)
ROUTING_KEYS = ("routed", "predicted_cached_tokens", "actual_cached_tokens")


def replica_load(stats: dict[str, Any]) -> dict[str, Any]:
    """One engine replica's figures from its `stats()` dict, plus its request queue's."""
    queue = stats["queue"]
    return {**{k: stats[k] for k in LOAD_KEYS}, "queued": queue["queued"], "in_flight": queue["in_flight"]}


def _error_text(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:300]


def pool_state(
    name: str,
    role: str,
    health: dict[str, Any],
    checks: list[tuple[str, object]],
    stats: list[tuple[str, object]],
    router: dict[str, Any] | None,
    routing: dict[str, dict[str, int]],
) -> dict[str, Any]:
    """One pool's entry. `health`: its /health entry (made from `checks`); `checks` and `stats`:
    (replica id, the replica's answer or the exception its call raised) of the health check and of
    `stats`; `router`: this router replica's queue for the pool (None: a pool it sends no requests
    to); `routing`: replica id -> this router replica's routing counters."""
    loads = {rid: s for rid, s in stats if isinstance(s, dict)}
    replicas = []
    for rid, check in checks:
        s = loads.get(rid)
        counts = routing.get(rid)
        replicas.append(
            {
                "replica_id": rid,
                "healthy": not isinstance(check, BaseException),
                "error": _error_text(check) if isinstance(check, BaseException) else None,
                "node_id": s["node_id"] if s is not None else None,
                "load": replica_load(s) if s is not None else None,
                "routing": {k: counts[k] for k in ROUTING_KEYS} if counts is not None else None,
            }
        )
    # Totals as /metrics sums them: over the replicas whose stats arrived.
    agg = aggregate(list(loads.values()))
    queries = agg["prefix_cache_queries"]
    return {
        "name": name,
        "role": role,
        "status": health["status"],
        "expected_replicas": health["expected_replicas"],
        "replicas": replicas,
        "totals": {
            "num_running": agg["num_running"],
            "num_waiting": agg["num_waiting"],
            "kv_usage": agg["kv_cache_usage"],
            "prefix_cache_queries": queries,
            "prefix_cache_hits": agg["prefix_cache_hits"],
            "prefix_hit_rate": agg["prefix_cache_hits"] / queries if queries else 0.0,
        },
        "router": (
            {k: router[k] for k in ("queued", "in_flight", "rejected", "migrations", "migration_failures")}
            if router is not None
            else None
        ),
    }
