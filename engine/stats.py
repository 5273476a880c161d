"""EngineStats: the engine's state after a step, as one immutable value.

The step thread publishes a fresh snapshot after every step; metrics, autoscaling and routing
stats read the latest one from any thread, never the scheduler's live structures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0  # sequences in the running batch
    num_waiting: int = 0  # sequences not scheduled yet, preempted ones included
    num_preemptions: int = 0  # cumulative
    num_steps: int = 0  # cumulative
    num_blocks: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    blocks_cached: int = 0  # free blocks still holding a cached prefix
    kv_usage: float = 0.0  # blocks_used / num_blocks
    prefix_cache_queries: int = 0  # cumulative, in tokens
    prefix_cache_hits: int = 0  # cumulative, in tokens
    prefix_hit_rate: float = 0.0
    num_evictions: int = 0  # cumulative: cached blocks reused for other contents
    kv_waste: float = 0.0  # share of the running requests' allocated slots holding no token
    # time.monotonic() arrival of the oldest request never scheduled yet (None: there is none)
    oldest_unscheduled_arrival: float | None = None

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["usage"] = self.kv_usage  # the name the KV-cache manager's figures use
        return d
