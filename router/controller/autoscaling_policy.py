"""Orbital's autoscaling policy: how many engine replicas a pool wants, from the replicas' own
stats (see `router/replica/autoscaling_stats.py`).

Serve's controller calls it every control-loop tick (0.1 s) with an `AutoscalingContext`;
Serve then applies, on top of what it returns: the up/down scaling factors, `min_replicas` /
`max_replicas`, and `upscale_delay_s` / `downscale_delay_s` (the wish must hold that long).
Configured through `router/controller/autoscaling_config.py` as
`AutoscalingPolicy(policy_function="router.controller.autoscaling_policy:OrbitalPolicy", policy_kwargs=...)`.

Each configured target gives a replica count; the pool wants the largest:

  ongoing   total requests (Serve's count at the callers, or the replicas' own `in_flight`,
            whichever is larger) / `target_ongoing_requests`
  kv        n * mean KV cache usage / `target_kv_cache_usage`
  queue     n * worst replica's queue wait / `target_queue_wait_s`
  ttft      n * worst replica's recent time to first token / `ttft_slo_s`
  ttft_p95  n * worst replica's recent p95 time to first token / `ttft_p95_slo_s`
  itl_p95   n * worst replica's recent p95 inter-token latency / `itl_p95_slo_s`

(n = running replicas). The latency signals go both ways: a pool well inside its SLO asks
for fewer replicas, an idle one reports 0 and leaves the decision to the other signals. A
latency signal asks for at most `max_step` times the current replicas per decision, so one
slow outlier does not jump the pool to `max_replicas`.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

log = logging.getLogger("ray.serve")

LOG_EVERY_S = 10.0


def _values(metrics: dict, name: str) -> list[float]:
    return [float(v) for v in (metrics.get(name) or {}).values() if v is not None]


def desired_replicas(
    n: int,
    total_requests: float,
    metrics: dict[str, dict[Any, float]],
    *,
    target_ongoing_requests: float,
    target_kv_cache_usage: float | None = None,
    target_queue_wait_s: float | None = None,
    ttft_slo_s: float | None = None,
    ttft_p95_slo_s: float | None = None,
    itl_p95_slo_s: float | None = None,
    max_step: float = 2.0,
) -> tuple[float, dict[str, float]]:
    """(replicas wanted, per-signal wishes). Pure: the policy class and the unit tests use it."""
    in_flight = sum(_values(metrics, "in_flight"))
    ongoing = max(float(total_requests or 0.0), in_flight)
    signals = {"ongoing": ongoing / target_ongoing_requests}
    cap = max(1.0, n * max_step)
    if target_kv_cache_usage:
        kv = _values(metrics, "kv_cache_usage")
        if kv:
            signals["kv"] = min(cap, n * (sum(kv) / len(kv)) / target_kv_cache_usage)
    if target_queue_wait_s:
        qw = _values(metrics, "queue_wait_s")
        if qw:
            signals["queue"] = min(cap, n * max(qw) / target_queue_wait_s)
    for signal, metric, target in (
        ("ttft", "ttft_s", ttft_slo_s),
        ("ttft_p95", "ttft_p95_s", ttft_p95_slo_s),
        ("itl_p95", "itl_p95_s", itl_p95_slo_s),
    ):
        values = _values(metrics, metric) if target else []
        if values:
            signals[signal] = min(cap, n * max(values) / target)
    return max(signals.values()), signals


class OrbitalPolicy:
    """Serve instantiates it once per deployment with `policy_kwargs`, then calls it per tick."""

    def __init__(
        self,
        target_ongoing_requests: float = 8.0,
        target_kv_cache_usage: float | None = None,
        target_queue_wait_s: float | None = None,
        ttft_slo_s: float | None = None,
        ttft_p95_slo_s: float | None = None,
        itl_p95_slo_s: float | None = None,
        max_step: float = 2.0,
    ) -> None:
        if target_ongoing_requests <= 0:
            raise ValueError(f"target_ongoing_requests must be > 0, got {target_ongoing_requests}")
        self.kwargs = dict(
            target_ongoing_requests=target_ongoing_requests,
            target_kv_cache_usage=target_kv_cache_usage,
            target_queue_wait_s=target_queue_wait_s,
            ttft_slo_s=ttft_slo_s,
            ttft_p95_slo_s=ttft_p95_slo_s,
            itl_p95_slo_s=itl_p95_slo_s,
            max_step=max_step,
        )
        self._last_log = 0.0

    def __call__(self, ctx) -> tuple[float, dict[str, Any]]:
        n = ctx.current_num_replicas
        state = dict(ctx.policy_state or {})
        if n == 0:  # Serve's cold-start path covers 0 -> 1 when requests are queued
            return ctx.target_num_replicas, state
        want, signals = desired_replicas(n, ctx.total_num_requests, ctx.aggregated_metrics or {}, **self.kwargs)
        state["orbital_signals"] = signals
        now = time.monotonic()
        if math.ceil(want - 1e-9) != n and now - self._last_log > LOG_EVERY_S:
            self._last_log = now
            log.info(
                "orbital autoscaling %s: %d running, wants %.2f (%s)",
                ctx.deployment_name,
                n,
                want,
                ", ".join(f"{k}={v:.2f}" for k, v in signals.items()),
            )
        return want, state
