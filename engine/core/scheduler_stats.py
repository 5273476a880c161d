"""The scheduler's figures after a step, as one immutable EngineStats (engine/stats.py)."""

from __future__ import annotations

from engine.request import RequestStatus
from engine.stats import EngineStats


class SchedulerStats:
    """A part of `Scheduler` (engine/core/scheduler.py), which holds the state it works on."""

    def snapshot(self) -> EngineStats:
        """The state after the last step (built on the step thread; read anywhere)."""
        kv = self.kv_cache_manager.stats(self.running)
        d, rp = self.drafting, self.remote
        unscheduled = [
            r.arrival_time for r in self.waiting if r.status == RequestStatus.WAITING and r.first_scheduled_time is None
        ]
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            num_request_faults=self.faults.num_isolated,
            num_steps=self.num_steps,
            num_blocks=kv["num_blocks"],
            kv_capacity_tokens=kv["num_blocks"] * self.kv_cache_manager.block_size,
            blocks_used=kv["blocks_used"],
            blocks_free=kv["blocks_free"],
            blocks_cached=kv["blocks_cached"],
            kv_usage=kv["usage"],
            prefix_cache_queries=kv["prefix_cache_queries"],
            prefix_cache_hits=kv["prefix_cache_hits"],
            prefix_hit_rate=kv["prefix_hit_rate"],
            num_evictions=kv["num_evictions"],
            kv_waste=kv["kv_waste"],
            oldest_unscheduled_arrival=min(unscheduled) if unscheduled else None,
            spec_num_drafts=d.num_drafts if d else 0,
            spec_num_draft_tokens=d.num_draft_tokens if d else 0,
            spec_num_accepted_tokens=d.num_accepted_tokens if d else 0,
            num_waiting_for_remote_kv=len(rp.waiting),
            num_remote_prefills=rp.num_remote,
            num_local_prefills=rp.num_local,
            num_remote_prefill_failures=rp.num_failed,
            num_peer_fetches=rp.num_peer,
            num_peer_fetch_failures=rp.num_peer_failed,
            lora_loaded=tuple(self.lora.loaded()) if self.lora else (),
            num_lora_loads=self.lora.num_loads if self.lora else 0,
            num_lora_evictions=self.lora.num_evictions if self.lora else 0,
            **(self.offload.stats() if self.offload is not None else {}),
        )

    def stats(self) -> dict:
        return self.snapshot().as_dict()
