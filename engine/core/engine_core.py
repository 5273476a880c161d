"""Scheduler + executor: one step = schedule, run the model, update requests. Token ids only."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from engine.config import CacheConfig, SchedulerConfig
from engine.core.kv_events import KVEventLog
from engine.core.prefill_speed import PrefillSpeed
from engine.core.scheduler import Scheduler
from engine.errors import EngineDeadError
from engine.kv_transfer.awaiting_kv import KVLoadRequest
from engine.kv_transfer.blocks import KVBlocks
from engine.kv_transfer.cached_export import export_cached
from engine.kv_transfer.config import KVTransferConfig
from engine.outputs import EngineCoreOutput
from engine.request import Request, RequestStatus
from engine.runner.executor import Executor
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_length import StepCostModel
from engine.stats import EngineStats
from engine.step_threads import StepThreads

if TYPE_CHECKING:
    from engine.lora.config import LoRAConfig
    from engine.lora.request import LoRARequest
    from engine.spec_decode.draft_model import DraftModelProposer


class EngineCore:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        executor: Executor,
        spec_config: SpeculativeConfig | None = None,
        kv_transfer: KVTransferConfig | None = None,
        draft_model: DraftModelProposer | None = None,
        step_threads: StepThreads | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        self.executor = executor
        self.step_threads = step_threads
        cost = None
        if spec_config is not None and spec_config.adaptive:
            # The verify step's cost on this machine, before any request uses the KV pool.
            table = executor.measure_step_costs(scheduler_config.max_num_seqs, spec_config.num_speculative_tokens)
            cost = StepCostModel(table) if table else None
        self.scheduler = Scheduler(
            scheduler_config,
            cache_config,
            executor.num_blocks,
            spec_config,
            cost,
            kv_transfer,
            draft_model,
            lora_config,
            executor.num_offload_slots,
        )
        self.kv_layout = executor.kv_layout()
        self.kv_events = KVEventLog()  # the prefix-cache hashes held here, for cache-aware routing
        self.fatal_suspects: set[str] = set()  # requests first run in the step that killed the engine
        # Steps launched and not completed, oldest first: up to `max_in_flight` when the executor
        # runs pipeline micro-batches (each stage busy with its own step), else one at a time.
        self._pipe: deque[StepInFlight] = deque()
        self.max_in_flight = executor.max_concurrent_batches
        self.max_in_flight_seen = 0
        self.prefill_speed = PrefillSpeed()  # what a fetch from a peer is weighed against

    @property
    def max_in_flight(self) -> int:
        return self.scheduler.micro_batches

    @max_in_flight.setter
    def max_in_flight(self, n: int) -> None:
        """Steps kept in flight (at most the executor's max_concurrent_batches; 1 turns the
        micro-batches off, as bench/bench_pp.py compares)."""
        self.scheduler.micro_batches = max(1, min(n, self.executor.max_concurrent_batches))

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

    @property
    def num_in_flight(self) -> int:
        return len(self._pipe)

    def step(self) -> list[EngineCoreOutput]:
        """Launch steps while fewer than `max_in_flight` are in flight and a new one has work to
        run, then complete the oldest and return its outputs: outputs come in launch order. With
        `max_in_flight` 1: schedule, run, update. A request is in one step in flight at most
        (Scheduler.in_pipe)."""
        pipe = self._pipe
        if not pipe:
            step = self.begin_step()
            if step.outputs is not None:  # it ran nothing, or failed at launch
                return step.outputs
            pipe.append(step)
        while len(pipe) < self.max_in_flight and self.scheduler.can_launch():
            so = self.scheduler.schedule()
            self.publish_kv_events()
            if so.only_forgets:  # nothing new to run: its ids to forget go with the next step
                self.scheduler.carry(so)
                break
            pipe.append(self._launch(so))
        self.max_in_flight_seen = max(self.max_in_flight_seen, len(pipe))
        return self.finish_step(pipe.popleft())

    def begin_step(self) -> StepInFlight:
        """Schedule and launch a step: on CUDA the model's work is queued and this returns before
        it ends, so the caller can process the previous step's text meanwhile. `finish_step`
        must follow before the next `begin_step`. Requests finished or aborted in between keep
        their scheduled work; its tokens are dropped (update_from_output skips them)."""
        so = self.scheduler.schedule()
        # Published before the model runs: the blocks are in the hash map once scheduled.
        self.publish_kv_events()
        if not so.needs_run:
            return StepInFlight(so, outputs=self.scheduler.update_from_output(so, _EMPTY))
        return self._launch(so)

    def _launch(self, so: SchedulerOutput) -> StepInFlight:
        if self.step_threads is not None:
            self.step_threads.apply(so.total_num_scheduled_tokens)
        t0 = time.perf_counter()
        try:
            return StepInFlight(so, self.executor.launch_model(so), t0)
        except Exception as e:
            return StepInFlight(so, outputs=self._step_failed(so, e))

    def finish_step(self, step: StepInFlight) -> list[EngineCoreOutput]:
        if step.outputs is not None:
            return step.outputs
        so = step.so
        try:
            mro = step.complete()
        except Exception as e:
            later = [] if isinstance(e, EngineDeadError) else self._abandon_pipe()
            return self._step_failed(so, e) + later
        seconds = time.perf_counter() - step.started
        self.scheduler.observe_step_time(so, seconds)
        self.prefill_speed.observe(so.num_scheduled_tokens.values(), seconds)
        outputs = self.scheduler.update_from_output(so, mro)
        self._export_kv(outputs)
        return outputs

    def _step_failed(self, so: SchedulerOutput, e: Exception) -> list[EngineCoreOutput]:
        # A rank gone (tp>1) leaves nothing to isolate; else step_faults.py.
        outputs = None if isinstance(e, EngineDeadError) else self.scheduler.isolate_fault(so, e)
        if outputs is None:
            self.fatal_suspects = {r.request_id for r in so.new_requests}
            raise e
        return outputs

    def _abandon_pipe(self) -> list[EngineCoreOutput]:
        """A step failed: the steps launched after it are completed, their results dropped and
        their requests rolled back, newest first (Scheduler.roll_back). Returns the outputs of
        those that had failed at launch (rolled back then)."""
        steps, outputs, results = list(self._pipe), [], []
        self._pipe.clear()
        for step in steps:
            mro = None
            if step.outputs is not None:
                outputs += step.outputs
            else:
                try:
                    mro = step.complete()
                except EngineDeadError:
                    raise
                except Exception:  # noqa: BLE001 - rolled back below like the others
                    pass
            results.append(mro)
        for step, mro in reversed(list(zip(steps, results))):
            if step.outputs is None:
                self.scheduler.roll_back(step.so, mro)
        return outputs

    # --- disaggregated serving (engine/kv_transfer/) ---------------------------------------

    def _export_kv(self, outputs: list[EngineCoreOutput]) -> None:
        """Prefill side: read out the blocks of requests that asked for it, then free them. Read
        on the step thread right after the step that filled them, before any other allocation."""
        exports = self.scheduler.exports.take()
        if not exports:
            return
        by_id = {o.request_id: o for o in outputs}
        for req, block_ids in exports:
            try:
                data = self.executor.read_kv_blocks(block_ids)
            finally:
                self.scheduler.exports.release(req)
            out = by_id.get(req.request_id)
            if out is not None:
                out.kv_blocks = KVBlocks(self.kv_layout, req.kv_export_first_block, req.num_prompt_tokens, data)

    def take_kv_loads(self) -> list[KVLoadRequest]:
        """Decode side: the remote prefills to perform (the caller moves the KV, then calls
        `load_kv` or `kv_load_failed`)."""
        return self.scheduler.take_kv_loads()

    def load_kv(self, request_id: str, blocks: KVBlocks) -> None:
        """Write a remote prefill's KV into the request's blocks; it is then scheduled for the
        rest of its prompt. A request aborted meanwhile is ignored; a payload that does not fit
        its request (layout, block count) is treated as a failed load."""
        target = self.scheduler.remote_kv_target(request_id)
        if target is None:
            return
        blocks.check(self.kv_layout, len(target))
        self.executor.write_kv_blocks(target, blocks.data)
        self.scheduler.remote_kv_done(request_id, loaded=True)

    def kv_load_failed(self, request_id: str, error: str | None = None) -> None:
        """A remote prefill failed: recompute it here (`error` None) or fail the request."""
        self.scheduler.remote_kv_done(request_id, loaded=False, error=error)

    def export_cached_kv(
        self,
        prompt_token_ids: list[int],
        first_block: int,
        num_blocks: int,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> KVBlocks | None:
        """A peer's fetch: these blocks of the prompt's prefix, read out of this engine's prefix
        cache (None: not all of them are cached here). Between steps only."""
        return export_cached(
            self.scheduler.kv_cache_manager,
            self.executor.read_kv_blocks,
            self.kv_layout,
            prompt_token_ids,
            first_block,
            num_blocks,
            lora_request,
            cache_salt,
        )

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def publish_kv_events(self) -> None:
        self.kv_events.publish(self.scheduler.kv_cache_manager.block_pool.events.take())

    def snapshot(self) -> EngineStats:
        return dataclasses.replace(
            self.scheduler.snapshot(),
            num_steps_in_flight=len(self._pipe),
            max_steps_in_flight=self.max_in_flight_seen,
            prefill_tokens_per_s=self.prefill_speed.tokens_per_s,
        )

    def stats(self) -> dict:
        return self.snapshot().as_dict()

    def shutdown(self) -> None:
        self.executor.shutdown()


from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput  # noqa: E402

_EMPTY = ModelRunnerOutput()


@dataclass
class StepInFlight:
    """A launched step: `complete` waits for its model output; `outputs` set when the step
    needed no model run or failed at launch."""

    so: SchedulerOutput
    complete: Callable[[], ModelRunnerOutput] | None = None
    started: float = 0.0
    outputs: list[EngineCoreOutput] | None = None
