"""What an engine replica tells Serve's autoscaler about itself (`record_autoscaling_stats`).

Serve calls the replica's `record_autoscaling_stats()` every `look_back_period_s * 0.2` s,
pushes the points to the controller every `RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S`
(the pool's `metrics_interval_s`), and hands the policy (`router/autoscaling_policy.py`) the
mean of each figure over the look-back window, per replica. All figures are floats:

  * `in_flight`     requests this replica holds (queued, prefilling or decoding);
  * `num_running`   sequences in the engine's running batch;
  * `num_waiting`   sequences the scheduler has not scheduled yet (incl. preempted);
  * `kv_cache_usage` fraction of KV blocks in use (0..1);
  * `queue_wait_s`  how long the oldest never-scheduled request has waited, or the mean
                    queue time of requests first scheduled since the previous call;
  * `ttft_s`        mean time to first token of requests that got it since the previous
                    call, or the age of the oldest request still without one (so a stuck
                    queue raises it before any first token arrives).
Idle replicas report 0 for the latency figures.
"""
from __future__ import annotations

import time

from engine.request import RequestStatus


class AutoscalingStats:
    """Turns an EngineReplica's cumulative histograms into per-interval figures."""

    def __init__(self, replica):
        self.replica = replica
        self._last: dict[str, tuple[int, float]] = {}  # histogram name -> (count, sum)

    def _recent_mean(self, name: str) -> float:
        h = self.replica.hist[name]
        count, total = h.count, h.total
        last_count, last_total = self._last.get(name, (0, 0.0))
        self._last[name] = (count, total)
        if count > last_count:
            return (total - last_total) / (count - last_count)
        return 0.0

    def _oldest_unscheduled_age(self) -> float:
        """Age (s) of the oldest request the scheduler has never scheduled (0 if none)."""
        sched = self.replica.engine.engine.core.scheduler
        try:
            waiting = list(sched.waiting)  # the step thread may append meanwhile
        except RuntimeError:
            return 0.0
        oldest = None
        for r in waiting:
            if r.status == RequestStatus.WAITING and r.first_scheduled_time is None:
                oldest = r.arrival_time if oldest is None else min(oldest, r.arrival_time)
        return 0.0 if oldest is None else max(0.0, time.monotonic() - oldest)

    def snapshot(self) -> dict[str, float]:
        r = self.replica
        sched = r.engine.engine.core.scheduler
        unscheduled = self._oldest_unscheduled_age()
        return {
            "in_flight": float(r.queue.in_flight),
            "num_running": float(len(sched.running)),
            "num_waiting": float(len(sched.waiting)),
            "kv_cache_usage": float(sched.kv_cache_manager.usage()),
            "queue_wait_s": max(self._recent_mean("request_queue_time_seconds"), unscheduled),
            "ttft_s": max(self._recent_mean("time_to_first_token_seconds"), unscheduled),
        }
