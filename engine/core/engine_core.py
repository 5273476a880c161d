"""Scheduler + executor: one step = schedule, run the model, update requests. Token ids only."""

from __future__ import annotations

import time
from typing import Iterable

from engine.config import CacheConfig, SchedulerConfig
from engine.core.kv_events import KVEventLog
from engine.core.scheduler import Scheduler
from engine.executor import Executor
from engine.outputs import EngineCoreOutput
from engine.request import Request, RequestStatus
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_length import StepCostModel
from engine.stats import EngineStats


class EngineCore:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        executor: Executor,
        spec_config: SpeculativeConfig | None = None,
    ) -> None:
        self.executor = executor
        cost = None
        if spec_config is not None and spec_config.adaptive:
            # The verify step's cost on this machine, before any request uses the KV pool.
            table = executor.measure_step_costs(scheduler_config.max_num_seqs, spec_config.num_speculative_tokens)
            cost = StepCostModel(table) if table else None
        self.scheduler = Scheduler(scheduler_config, cache_config, executor.num_blocks, spec_config, cost)
        self.kv_events = KVEventLog()  # the prefix-cache hashes held here, for cache-aware routing

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def finish_requests(
        self, request_ids: str | Iterable[str], status: RequestStatus = RequestStatus.FINISHED_STOPPED
    ) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        so = self.scheduler.schedule()
        # Published before the model runs: the blocks are in the hash map once scheduled.
        self.publish_kv_events()
        if so.is_empty and not so.finished_request_ids and not so.preempted_request_ids:
            return self.scheduler.update_from_output(so, _EMPTY)
        t0 = time.perf_counter()
        mro = self.executor.execute_model(so)
        self.scheduler.observe_step_time(so, time.perf_counter() - t0)
        return self.scheduler.update_from_output(so, mro)

    def publish_kv_events(self) -> None:
        self.kv_events.publish(self.scheduler.kv_cache_manager.block_pool.events.take())

    def snapshot(self) -> EngineStats:
        return self.scheduler.snapshot()

    def stats(self) -> dict:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        self.executor.shutdown()


from engine.core.scheduler_output import ModelRunnerOutput  # noqa: E402

_EMPTY = ModelRunnerOutput()
