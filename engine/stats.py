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
    num_request_faults: int = 0  # cumulative: requests failed alone for a step they broke
    num_steps: int = 0  # cumulative
    num_blocks: int = 0
    kv_capacity_tokens: int = 0  # tokens the KV pool holds: num_blocks * block_size (its dtype decides how many)
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
    # Speculative decoding, cumulative: verifications that carried drafts, draft tokens scored,
    # draft tokens accepted (the bonus/correction token is not counted).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # Disaggregated serving, decode side (cumulative but the first): sequences holding blocks
    # while their KV is computed elsewhere; prefills asked of a prefill engine; prefills done
    # here because the uncached suffix was short; loads that failed (recomputed or failed).
    num_waiting_for_remote_kv: int = 0
    num_remote_prefills: int = 0
    num_local_prefills: int = 0
    num_remote_prefill_failures: int = 0
    # Fetches from a peer's prefix cache (any engine, cumulative): asked of the caller, and of
    # those the ones that failed (recomputed here).
    num_peer_fetches: int = 0
    num_peer_fetch_failures: int = 0
    # Prompt tokens per second of this engine's prefill steps (a moving average; None: none yet).
    prefill_tokens_per_s: float | None = None
    # Multi-LoRA (engine/lora/slots.py): adapters held in host memory (least recently used first),
    # and cumulative: adapters read from disk, adapters dropped from host memory.
    lora_loaded: tuple[str, ...] = ()
    num_lora_loads: int = 0
    num_lora_evictions: int = 0
    # The offload tier (engine/kv_offload/; all 0 when off). Prefix hits per tier: of the
    # prefix_cache_hits (every tier), prefix_cache_hits_offload were loaded from the offload tier.
    # Blocks: the tier's capacity and what it holds now; cumulative: saved on eviction, loaded
    # on a hit, dropped by its LRU for newer ones, loads that failed (recomputed instead).
    prefix_cache_hits_offload: int = 0
    offload_capacity_blocks: int = 0
    offload_blocks_held: int = 0
    offload_blocks_saved: int = 0
    offload_blocks_loaded: int = 0
    offload_blocks_dropped: int = 0
    offload_load_failures: int = 0
    num_waiting_for_offload: int = 0
    # Engine steps launched and not yet completed (pipeline micro-batches: up to the executor's
    # max_concurrent_batches), now and the most seen at once.
    num_steps_in_flight: int = 0
    max_steps_in_flight: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verification: the accepted drafts plus one."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["usage"] = self.kv_usage  # the name the KV-cache manager's figures use
        d["spec_acceptance_rate"] = self.spec_acceptance_rate
        d["spec_mean_accepted_length"] = self.spec_mean_accepted_length
        return d
