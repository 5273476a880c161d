"""Continuous-batching scheduler (vLLM V1 semantics): one token budget per step.

Every scheduled request gets "compute the next N tokens" (ARCHITECTURE.md, rule 2): running requests first,
then waiting ones in policy order. Chunked prefill is what happens when N is cut by the budget.
Progress (`num_computed_tokens`) advances in schedule(); update_from_output() appends sampled
tokens and applies stop conditions.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Iterable

from engine.config import CacheConfig, SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_handoffs import KVHandoffs
from engine.core.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from engine.core.scheduler_stats import SchedulerStats
from engine.core.step_faults import StepFaults
from engine.core.step_recovery import StepRecovery
from engine.core.step_results import StepResults
from engine.kv_transfer.awaiting_kv import RemotePrefill
from engine.kv_transfer.config import KVTransferConfig
from engine.kv_transfer.exports import KVExports
from engine.lora.batch import NO_SLOT
from engine.lora.config import LoRAConfig
from engine.lora.slots import AdapterSlots
from engine.outputs import EngineCoreOutput, TokenLogprob
from engine.request import Request, RequestStatus
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_length import StepCostModel
from engine.spec_decode.drafting import Drafting
from engine.structured.matcher import step_bitmasks

if TYPE_CHECKING:
    from engine.spec_decode.draft_model import DraftModelProposer


class Scheduler(StepResults, KVHandoffs, StepRecovery, SchedulerStats):
    """The state and the step's schedule; the parts that act on that state live beside it:
    StepResults (engine/core/step_results.py), KVHandoffs (kv_handoffs.py: the offload tier, a
    prefill engine's or a peer's KV), StepRecovery (step_recovery.py: failed steps) and
    SchedulerStats (scheduler_stats.py)."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        spec_config: SpeculativeConfig | None = None,
        step_cost: StepCostModel | None = None,
        kv_transfer: KVTransferConfig | None = None,
        draft_model: DraftModelProposer | None = None,
        lora_config: LoRAConfig | None = None,
        offload_slots: int = 0,
    ) -> None:
        """`offload_slots`: blocks the offload tier holds (0: off; executor.num_offload_slots)."""
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            cache_config.block_size,
            num_blocks,
            cache_config.enable_prefix_caching,
            cache_config.kv_cache_dtype,
            offload_slots,
            cache_config.kv_offload_medium,
        )
        # The offload tier's loads and the requests waiting for them (None: off).
        self.offload = self.kv_cache_manager.offload
        # Steps in flight with offload loads: id(so) -> (so, the request of each of its loads).
        self._offload_in_flight: dict[int, tuple[SchedulerOutput, list[str]]] = {}
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first; the last one is preempted first
        # Requests in a step launched and not yet done (several with pipeline micro-batches): not
        # scheduled again, nor preempted, until its output is in (update_from_output).
        self.in_pipe: set[str] = set()
        # Steps the pipe holds (EngineCore.max_in_flight). Above 1 a step takes at most its share
        # of the requests, so the next step has some too and every stage keeps busy.
        self.micro_batches = 1
        self.finished_req_ids: set[str] = set()  # since the last schedule()
        self._pending_outputs: list[EngineCoreOutput] = []  # errors found outside a step
        # Prompt logprobs arrive chunk by chunk; they are emitted once the prompt is complete.
        self._prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        self.num_preemptions = 0
        self.num_holders_released = 0  # waiting requests that gave back blocks they held (_release_waiting_holders)
        # The last schedule() could start nothing and nothing runs: the waiting head needs blocks
        # that requests waiting for their KV hold, or KV a fetch in flight brings. Only an event
        # (a request added or ended, a load done) changes that, so until one the engine's loop
        # sleeps instead of scheduling the same nothing again (has_work).
        self.stalled = False
        self.num_steps = 0
        # Speculative decoding (None: off).
        self.drafting = (
            Drafting(spec_config, scheduler_config, step_cost, draft_model) if spec_config is not None else None
        )
        self._truncated: dict[str, int] = {}  # block tables cut since the last schedule()
        # Requests waiting for KV from elsewhere: a prefill engine's (disaggregated serving, decode
        # side) or a peer's prefix cache (any engine). Prefill side: finished requests whose blocks
        # are read out before they are freed.
        self.remote = RemotePrefill(kv_transfer, self.kv_cache_manager)
        self.exports = KVExports(self.kv_cache_manager)
        self.faults = StepFaults()
        self._preempted_unsent: set[str] = set()  # preempted outside schedule(): the next step tells the runner
        # Multi-LoRA (None: off): adapter slots pinned by running requests (engine/lora/slots.py).
        self.lora = AdapterSlots(lora_config) if lora_config is not None else None

    # --- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        error = self._check_fits(request)
        if error is not None:
            request.status = RequestStatus.FINISHED_ERROR
            self._pending_outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="error", error=error))
            return
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.stalled = False

    def _check_fits(self, request: Request) -> str | None:
        """A request that could never fit would preempt itself forever: fail it up front."""
        p, max_len = request.num_prompt_tokens, self.config.max_model_len
        if p == 0:
            return "empty prompt"
        if p > max_len:
            return f"prompt has {p} tokens, more than max_model_len={max_len}"
        # The last sampled token is never computed, so it needs no KV slot.
        final_len = min(p + request.max_tokens, max(max_len, p + 1))
        need = self.kv_cache_manager.num_blocks_needed(final_len - 1)
        if need > self.kv_cache_manager.num_blocks:
            return (
                f"request needs {need} KV blocks ({final_len - 1} tokens) but the pool has "
                f"only {self.kv_cache_manager.num_blocks}; lower max_tokens or the prompt"
            )
        return None

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests in any state (abort, stop string matched on the text side)."""
        assert status.finished, status
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            else:
                self.remote.forget(rid)
                if self.offload is not None:
                    self.offload.forget(rid)
            req.status = status
            self._free_request(req)
            self.stalled = False

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def _free_request(self, req: Request) -> None:
        if req.kv_export_first_block is not None and req.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
        ):
            self.exports.add(req)  # freed by exports.release once its blocks are read
        else:
            self.kv_cache_manager.free(req)
        if self.lora is not None:
            self.lora.release(req.request_id)
        if self.drafting is not None:
            self.drafting.forget(req.request_id)
            self._truncated.pop(req.request_id, None)
        self._prompt_logprobs.pop(req.request_id, None)
        self.faults.quarantined.discard(req.request_id)
        del self.requests[req.request_id]
        self.finished_req_ids.add(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._pending_outputs or self.num_waiting_for_remote_kv)

    def has_work(self) -> bool:
        """Something a step could do now (requests waiting for remote KV need no step, nor
        waiting ones while `stalled`)."""
        return bool((self.waiting and not self.stalled) or self.running or self._pending_outputs)

    def get_num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + self.num_waiting_for_remote_kv

    @property
    def num_waiting_for_remote_kv(self) -> int:
        """Requests holding blocks while their KV arrives: from a prefill engine or the offload tier."""
        remote = len(self.remote.waiting)
        return remote + (len(self.offload.waiting) if self.offload is not None else 0)

    # --- schedule ---------------------------------------------------------------------------

    def _num_new_tokens(self, req: Request, budget: int, num_hit: int = 0) -> int:
        n = min(req.num_tokens - req.num_computed_tokens - num_hit, budget)
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _outside_pipe(self) -> list[Request]:
        """The running requests no step in flight holds (the ones a new step may schedule)."""
        return [r for r in self.running if r.request_id not in self.in_pipe] if self.in_pipe else self.running

    def _pick_victim(self) -> Request:
        """Newest running request, or under "priority" the least important (then newest); never
        one in a step in flight (its step would write blocks given to another)."""
        candidates = self._outside_pipe()
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, req: Request, count: bool = True) -> None:
        self.kv_cache_manager.free(req)
        if self.lora is not None:
            self.lora.release(req.request_id)
        self._truncated.pop(req.request_id, None)
        if self.drafting is not None:
            self.drafting.release(req.request_id)
        self._prompt_logprobs.pop(req.request_id, None)  # recomputed from scratch
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        if count:  # not a rollback after a failed step
            req.num_preemptions += 1
            self.num_preemptions += 1
        self.waiting.appendleft(req)

    def observe_step_time(self, so: SchedulerOutput, seconds: float) -> None:
        """A decode-only step's wall time, for the draft-length policy's cost correction."""
        if self.drafting is not None:
            self.drafting.observe_step_time(so, seconds)

    def _verified(self, req: Request, num_drafts: int, num_emitted: int) -> None:
        """Count a verification and roll back the KV of rejected drafts: the request's
        progress goes back and blocks past its tokens are freed (they never held a full block
        of its own tokens, so none is in the prefix cache)."""
        accepted = num_emitted - 1
        self.drafting.record(req.request_id, num_drafts, accepted)
        if accepted < num_drafts:
            req.num_computed_tokens -= num_drafts - accepted
            kept = self.kv_cache_manager.trim(req, req.num_computed_tokens)
            if kept is not None:
                self._truncated[req.request_id] = kept

    def schedule(self, isolate: bool = True) -> SchedulerOutput:
        """`isolate` False: schedule as if no request were quarantined (the quarantined one at the
        head could not be scheduled alone this step)."""
        out = SchedulerOutput()
        self.kv_cache_manager.begin_step()
        budget = self.config.max_num_batched_tokens
        new_block_ids: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        preempted: list[Request] = []
        released = 0

        # After a failed step: one quarantined request runs its step alone (step_faults.py).
        suspect = None
        if isolate and self.faults.quarantined:
            suspect = next((r for r in self.waiting if r.request_id in self.faults.quarantined), None)
        if suspect is not None:
            self.waiting.remove(suspect)
            self.waiting.appendleft(suspect)
        drafts = {}
        if self.drafting is not None and suspect is None:
            drafts = self.drafting.propose(self._outside_pipe(), self.waiting)

        # 1. Running requests, oldest first.
        share = -(-(len(self.running) + len(self.waiting)) // self.micro_batches)
        i = 0
        while suspect is None and i < len(self.running) and budget > 0 and len(out.num_scheduled_tokens) < share:
            req = self.running[i]
            n = self._num_new_tokens(req, budget) if req.request_id not in self.in_pipe else 0
            if n <= 0:
                i += 1
                continue
            draft = drafts.get(req.request_id) if req.sampling_params.pooling is None else None
            if draft and req.grammar is not None:  # only drafts its grammar allows
                draft = draft[: req.grammar.valid_prefix(draft)]
            if draft:
                draft = draft[: budget - n]  # the token budget counts draft tokens
                block_ids = self.kv_cache_manager.allocate_slots(req, n + len(draft)) if draft else None
                if block_ids is not None:  # else: no KV room for drafts; never preempt for them
                    n += len(draft)
                    out.scheduled_spec_tokens[req.request_id] = draft
            while not (draft and block_ids is not None):
                block_ids = self.kv_cache_manager.allocate_slots(req, n)
                if block_ids is not None:
                    break
                victim = self._pick_victim()
                vi = self.running.index(victim)
                del self.running[vi]
                if vi < i:  # priority policy can pick one already passed over
                    i -= 1
                if victim in scheduled_running:  # give its tokens back
                    scheduled_running.remove(victim)
                    budget += out.num_scheduled_tokens.pop(victim.request_id)
                    new_block_ids.pop(victim.request_id)
                    out.scheduled_spec_tokens.pop(victim.request_id, None)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if block_ids is None:
                continue  # req itself was preempted; self.running[i] is now the next one
            scheduled_running.append(req)
            new_block_ids[req.request_id] = block_ids
            out.num_scheduled_tokens[req.request_id] = n
            budget -= n
            i += 1

        # 2. Waiting requests, unless this step had to preempt (memory is short).
        scheduled_new: list[Request] = []
        no_slot: list[Request] = []  # their adapter found no free slot: passed over this step
        if not preempted:
            if self.config.policy == "priority" and suspect is None:
                self.waiting = deque(sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time)))
            while (
                self.waiting
                and budget > 0
                and len(self.running) + self.num_waiting_for_remote_kv < self.config.max_num_seqs
                and len(out.num_scheduled_tokens) < share
                and (suspect is None or self.waiting[0] is suspect)
            ):
                req = self.waiting[0]
                if not self._acquire_adapter(req):
                    no_slot.append(self.waiting.popleft())
                    continue
                tail = None
                holds = self._holds_blocks(req)
                if holds:  # its KV arrived (or is recomputed): blocks held
                    hit_blocks, num_hit = [], 0
                else:
                    hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(req)
                    offloaded = self.kv_cache_manager.offload_hits(req, len(hit_blocks))
                    num_offloaded = len(offloaded) * self.block_size
                    remote = self.remote.remote_tokens(req, num_hit + num_offloaded)
                    source = None
                    fetching = False
                    if not remote and (peer := self.remote.peer_tokens(req, num_hit + num_offloaded)):
                        # A fetch in flight brings the same blocks: wait, and hit them once they are here.
                        fetching = self.remote.fetching(req, num_hit + num_offloaded)
                        remote, source = peer, req.peer_prefix.source  # a peer holds more: all past the pool's hits
                    if (remote or offloaded) and self.lora is not None:
                        self.lora.release(req.request_id)  # pinned again once its KV is here
                    if fetching:
                        break
                    if remote:  # the prefill engine (or the peer) provides all past the pool's hits
                        if not self.remote.hold(req, hit_blocks, num_hit, remote, source):
                            break
                        self.kv_cache_manager.count_lookup(req, num_hit)
                        self.waiting.popleft()  # waits in self.remote until its KV arrives
                        continue
                    if offloaded:
                        if not self.offload.hold(self.kv_cache_manager, req, hit_blocks, num_hit, offloaded):
                            break
                        self.waiting.popleft()  # waits in self.offload for this step's loads
                        continue
                    tail = self.kv_cache_manager.find_tail(req, len(hit_blocks))
                    num_hit += tail.num_tokens if tail is not None else 0
                n = self._num_new_tokens(req, budget, num_hit)
                block_ids = self.kv_cache_manager.allocate_slots(req, n, hit_blocks, tail=tail)
                if block_ids is None:
                    if self.lora is not None:
                        self.lora.release(req.request_id)
                    if not self.running and not self.in_pipe:
                        released = self._release_waiting_holders()
                    break  # keep policy order: nobody jumps the head of the queue
                if not holds:
                    self.kv_cache_manager.count_lookup(req, len(hit_blocks) * self.block_size)
                self.waiting.popleft()
                req.num_computed_tokens += num_hit
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = time.monotonic()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                scheduled_new.append(req)
                out.num_scheduled_tokens[req.request_id] = n
                budget -= n
                if suspect is not None:
                    break
            self.waiting.extendleft(reversed(no_slot))  # their places in the queue kept
        if suspect is not None and not scheduled_new:  # no room or held for remote KV: as usual
            return self.schedule(isolate=False)

        # 3. Build the deltas, then advance the progress counters.
        for req in scheduled_new:
            out.new_requests.append(
                NewRequestData(
                    request_id=req.request_id,
                    prompt_token_ids=list(req.prompt_token_ids),
                    output_token_ids=list(req.output_token_ids),
                    sampling_params=req.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(req.request_id),
                    num_computed_tokens=req.num_computed_tokens,
                    lora_slot=self.lora.slot(req.request_id) if self.lora is not None else NO_SLOT,
                )
            )
        for req in scheduled_running:
            out.cached_requests.append(
                CachedRequestData(req.request_id, new_block_ids[req.request_id], req.num_computed_tokens)
            )
        for req in scheduled_new + scheduled_running:
            req.num_computed_tokens += out.num_scheduled_tokens[req.request_id]
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.grammar_bitmasks = step_bitmasks(scheduled_new + scheduled_running, out.scheduled_spec_tokens)
        out.kv_copies = self.kv_cache_manager.take_copies()
        if self.lora is not None:
            out.lora_loads, out.lora_evictions = self.lora.take_changes()
        if self.offload is not None:
            out.kv_saves, out.kv_loads, owners = self.offload.take_ops()
            if out.kv_loads:
                self._offload_in_flight[id(out)] = (out, owners)
        out.preempted_request_ids = {r.request_id for r in preempted} | self._preempted_unsent
        self._preempted_unsent = set()
        out.finished_request_ids = self.finished_req_ids
        self.finished_req_ids = set()
        if self._truncated:
            out.truncated_block_tables, self._truncated = self._truncated, {}
        self.in_pipe.update(out.num_scheduled_tokens)
        self.num_steps += 1
        self.stalled = bool(self.waiting) and not self.running and not released and not out.needs_run
        return out

    def can_launch(self) -> bool:
        """A step scheduled now could run something: a request waits, or one runs outside the
        steps in flight (it may still find no room; then `carry` takes its schedule back)."""
        return bool(self.waiting) or any(r.request_id not in self.in_pipe for r in self.running)

    def carry(self, so: SchedulerOutput) -> None:
        """`so` is not launched: it runs nothing while other steps are in flight. What the runner
        must forget goes with the next step (SchedulerOutput.only_forgets)."""
        self.finished_req_ids |= so.finished_request_ids
        self._preempted_unsent |= so.preempted_request_ids

    def _step_done(self, so: SchedulerOutput, failed_loads: set[int]) -> None:
        """The step of `so` is over, run or failed: its requests leave the pipe, the blocks it
        copied from are let go, its offload loads end (`failed_loads`: indices that failed)."""
        self.in_pipe.difference_update(so.num_scheduled_tokens)
        self.kv_cache_manager.release_copy_sources(src for src, _, _ in so.kv_copies)
        self._offload_loads_done(so, failed_loads)

    def _acquire_adapter(self, req: Request) -> bool:
        """Pin a slot for the request's adapter (a request of the base model needs none)."""
        if req.lora_request is None:
            return True
        if self.lora is None:  # the front end refuses these; never run one on the base model
            raise RuntimeError(f"request {req.request_id} names a LoRA adapter but LoRA is off")
        return self.lora.acquire(req.request_id, req.lora_request) is not None

    def reset_prefix_cache(self) -> None:
        self.kv_cache_manager.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.kv_cache_manager.check_integrity()
        # Block holders: running requests, those waiting for remote KV, and waiting ones back
        # from a remote prefill (status WAITING: a preempted request holds none).
        holders = {r.request_id for r in self.running} | {
            r.request_id for r in self.waiting if r.status == RequestStatus.WAITING and self._holds_blocks(r)
        }
        holders |= set(self.remote.waiting)
        if self.offload is not None:
            holders |= set(self.offload.waiting)
        assert set(self.kv_cache_manager.req_to_blocks) <= holders
        assert len(self.running) <= self.config.max_num_seqs
