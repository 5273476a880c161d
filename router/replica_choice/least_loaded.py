"""The load figure replicas are compared by (least-loaded ranking and cache-aware's load guard)."""

from __future__ import annotations

from typing import Any


def replica_load(queue_len: int | None, routing_stats: dict[str, Any]) -> float:
    """Lower is better. In-flight requests dominate; waiting and KV usage break ties."""
    inflight = queue_len if queue_len is not None else routing_stats.get("in_flight", 0)
    return inflight + 0.5 * routing_stats.get("num_waiting", 0) + routing_stats.get("kv_usage", 0.0)
