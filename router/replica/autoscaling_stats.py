"""What an engine replica tells Serve's autoscaler about itself (`record_autoscaling_stats`).

Serve calls the replica's `record_autoscaling_stats()` every `look_back_period_s * 0.2` s,
pushes the points to the controller every `RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S`
(the pool's `metrics_interval_s`), and hands the policy (`router/controller/autoscaling_policy.py`) the
mean of each figure over the look-back window, per replica. All figures are floats:

  * `in_flight`     requests this replica holds (queued, prefilling or decoding);
  * `num_running`   sequences in the engine's running batch;
  * `num_waiting`   sequences the scheduler has not scheduled yet (incl. preempted);
  * `kv_cache_usage` fraction of KV blocks in use (0..1);
  * `queue_wait_s`  how long the oldest never-scheduled request has waited, or the mean
                    queue time of requests first scheduled since the previous call;
  * `ttft_s`        mean time to first token of requests that got it since the previous
                    call, or the age of the oldest request still without one (so a stuck
                    queue raises it before any first token arrives);
  * `ttft_p95_s`    the 95th percentile of those times to first token (or that age);
  * `itl_p95_s`     the 95th percentile of the inter-token latencies since the previous call.
Idle replicas report 0 for the latency figures. The percentiles come from the histograms'
bucket counts (interpolated inside a bucket); Serve's mean over the look-back window of these
per-interval tails is what the policy compares with its p95 targets.
"""

from __future__ import annotations

import time

from engine.stats import EngineStats
from router.histogram import Histogram


class AutoscalingStats:
    """Turns an engine replica's cumulative histograms and the engine's stats snapshot into
    per-interval figures."""

    def __init__(self, histograms: dict[str, Histogram]) -> None:
        self.hist = histograms
        self._last: dict[str, tuple[int, float]] = {}  # histogram name -> (count, sum)
        self._last_counts: dict[str, list[int]] = {}  # histogram name -> bucket counts

    def _recent_mean(self, name: str) -> float:
        h = self.hist[name]
        count, total = h.count, h.total
        last_count, last_total = self._last.get(name, (0, 0.0))
        self._last[name] = (count, total)
        if count > last_count:
            return (total - last_total) / (count - last_count)
        return 0.0

    def _recent_p95(self, name: str) -> float:
        h = self.hist[name]
        since = self._last_counts.get(name)
        self._last_counts[name] = list(h.counts)
        return h.quantile(0.95, since)

    def snapshot(self, engine: EngineStats, in_flight: int) -> dict[str, float]:
        oldest = engine.oldest_unscheduled_arrival
        unscheduled = 0.0 if oldest is None else max(0.0, time.monotonic() - oldest)
        return {
            "in_flight": float(in_flight),
            "num_running": float(engine.num_running),
            "num_waiting": float(engine.num_waiting),
            "kv_cache_usage": float(engine.kv_usage),
            "queue_wait_s": max(self._recent_mean("request_queue_time_seconds"), unscheduled),
            "ttft_s": max(self._recent_mean("time_to_first_token_seconds"), unscheduled),
            "ttft_p95_s": max(self._recent_p95("time_to_first_token_seconds"), unscheduled),
            "itl_p95_s": self._recent_p95("inter_token_latency_seconds"),
        }
