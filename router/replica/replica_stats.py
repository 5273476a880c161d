"""What an engine replica reports about itself (`ReplicaStats`, a base of the `EngineReplica`
deployment, so Serve and the ingress's handle find these methods on it):

  * `stats()`: the engine's stats with this replica's counters, latency histograms, queue and
    KV transfer figures; the ingress sums them for /metrics and shows them on /cluster/state;
  * `record_routing_stats()`: load figures for the ingress's replica choice (Serve polls it);
  * `record_autoscaling_stats()`: figures for the autoscaling policy (`autoscaling_stats.py`).

Load figures come from the engine's stats snapshot (published after each step), never from the
scheduler's live structures.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from router.histogram import Histogram
from router.metrics import COUNTERS
from router.replica.autoscaling_stats import AutoscalingStats

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from router.backpressure import ReplicaQueue
    from router.replica.peer_fetch import PeerFetches
    from router.replica.prefill_client import RemotePrefills


class ReplicaStats:
    """Methods over the attributes `EngineReplica.__init__` sets and its requests update."""

    engine: AsyncEngine
    replica_id: str
    node_id: str
    queue: ReplicaQueue
    hist: dict[str, Histogram]
    counters: dict[str, int]  # prompt and generation tokens, requests resumed here (migrated_in)
    finished: dict[str, int]  # finish reason -> sequences
    channel_messages: int
    lease_expiries: int
    remote_prefills: RemotePrefills | None
    peer_fetches: PeerFetches
    _kv_bytes_per_block: int

    async def stats(self, replica_id: str | None = None) -> dict:
        s = self.engine.stats()
        s.update(self.counters)
        s["replica_id"] = self.replica_id
        s["pid"] = os.getpid()
        s["rank_pids"] = self.engine.rank_pids()
        s["node_id"] = self.node_id
        s["channel_messages"] = self.channel_messages
        s["router_lease_expiries"] = self.lease_expiries
        s["finished"] = dict(self.finished)
        s["histograms"] = {k: h.to_dict() for k, h in self.hist.items()}
        s["queue"] = self.queue.stats()
        s["alive"] = self.engine.is_alive()
        if self.remote_prefills is not None:
            s.update(self.remote_prefills.counters)
        s.update(self.peer_fetches.counters)
        s.update(self._speeds())
        for k in COUNTERS:
            s.setdefault(k, 0)
        return s

    def record_routing_stats(self) -> dict:
        """Load figures for replica choice (Serve polls this), from the engine's last snapshot."""
        snap = self.engine.snapshot
        return {
            "num_running": snap.num_running,
            "num_waiting": snap.num_waiting,
            "kv_usage": snap.kv_usage,
            "queued": len(self.queue.queued),
            "in_flight": self.queue.in_flight,
            "lora_loaded": list(snap.lora_loaded),  # adapter-aware replica choice
            **self._speeds(),  # whether a fetch from a peer beats recomputing here
        }

    def _speeds(self) -> dict:
        """Measured here (None: not yet; the replica choice then assumes its defaults)."""
        speed = self.peer_fetches.speed
        return {
            "prefill_tokens_per_s": self.engine.snapshot.prefill_tokens_per_s,
            "kv_fetch_bytes_per_s": speed.bytes_per_s,
            "kv_fetch_latency_s": speed.latency_s,
            "kv_bytes_per_block": self._kv_bytes_per_block,
        }

    def record_autoscaling_stats(self) -> dict:
        """Load figures for the autoscaling policy (Serve polls this when autoscaling is on)."""
        if not hasattr(self, "_autoscaling_stats"):
            self._autoscaling_stats = AutoscalingStats(self.hist)
        return self._autoscaling_stats.snapshot(self.engine.snapshot, self.queue.in_flight)
