"""Continuous-batching scheduler (vLLM V1 semantics): one token budget per step.

Every scheduled request gets "compute the next N tokens" (ARCHITECTURE.md, rule 2): running requests first,
then waiting ones in policy order. Chunked prefill is what happens when N is cut by the budget.
Progress (`num_computed_tokens`) advances in schedule(); update_from_output() appends sampled
tokens and applies stop conditions.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Iterable

from engine.config import CacheConfig, SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from engine.core.step_faults import StepFaults
from engine.kv_transfer.awaiting_kv import KVLoadRequest, RemotePrefill
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
from engine.stats import EngineStats
from engine.structured.matcher import step_bitmasks

if TYPE_CHECKING:
    from engine.spec_decode.draft_model import DraftModelProposer

log = logging.getLogger(__name__)


class Scheduler:
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
                    if not remote and (peer := self.remote.peer_tokens(req, num_hit + num_offloaded)):
                        if self.remote.fetching(req, num_hit + num_offloaded):
                            break  # a fetch in flight brings the same blocks: hit them once they are here
                        remote, source = peer, req.peer_prefix.source  # a peer holds more: all past the pool's hits
                    if (remote or offloaded) and self.lora is not None:
                        self.lora.release(req.request_id)  # pinned again once its KV is here
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

    def isolate_fault(self, so: SchedulerOutput, error: BaseException) -> list[EngineCoreOutput] | None:
        """The step of `so` raised `error` (step_faults.py): roll back every request it ran, fail
        the culprit or quarantine the suspects. Returns the outputs to hand out (the culprit's
        error), or None when the fault is the step's own (the caller re-raises)."""
        self._step_done(so, set(range(len(so.kv_loads))))  # no load is trusted: recomputed
        scheduled = [rid for rid in so.num_scheduled_tokens if rid in self.requests]
        new_ids = [r.request_id for r in so.new_requests if r.request_id in self.requests]
        culprit, suspects = self.faults.suspects(new_ids, scheduled)
        if culprit is None and not suspects:
            return None
        if culprit is not None and not self.faults.found_culprit(culprit):
            return None
        for rid in scheduled:
            req = self.requests[rid]
            if req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens -= so.num_scheduled_tokens[rid]  # this step's KV was never written
            self.running.remove(req)
            if rid == culprit:
                req.status = RequestStatus.FINISHED_ERROR
                self._free_request(req)
                msg = f"this request failed the engine step ({type(error).__name__}: {error}); it was not retried"
                self._pending_outputs.append(
                    EngineCoreOutput(rid, [], finish_reason="error", error=msg[:500], error_kind="internal")
                )
            else:
                self._preempt(req, count=False)
                self._preempted_unsent.add(rid)
        self.faults.quarantined.update(suspects)
        if self.lora is not None:
            self.lora.unplace(so.lora_loads)
        log.warning(
            "engine step failed (%s: %s); %s",
            type(error).__name__,
            error,
            f"request {culprit} failed alone" if culprit else f"quarantined {len(suspects)} new request(s)",
        )
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def roll_back(self, so: SchedulerOutput, mro: ModelRunnerOutput | None) -> None:
        """Drop the results of a step launched after one that failed (`mro`: its output, None if
        it raised too): it may have read KV the failed step never wrote (a prefix hit or a tail
        copy of a block that step was to fill). Its requests are recomputed from scratch with
        none of their blocks kept in the prefix cache. Roll back the newest step first, so the
        failed step's blocks are no longer shared when its own requests let go of them."""
        self._step_done(so, set(mro.kv_load_failed) if mro is not None else set(range(len(so.kv_loads))))
        for rid in so.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens = 0  # free() then unpublishes all its blocks, remembers no tail
            self.running.remove(req)
            self._preempt(req, count=False)
            self._preempted_unsent.add(rid)
        if mro is None and self.lora is not None:
            self.lora.unplace(so.lora_loads)

    # --- the offload tier (engine/kv_offload/) ---------------------------------------------

    def _offload_loads_done(self, so: SchedulerOutput, failed: set[int]) -> None:
        """The loads of the step of `so` ran (`failed`: indices of those that did not): their
        requests go back to the head of the queue holding their blocks."""
        entry = self._offload_in_flight.pop(id(so), None)  # the entry holds `so`: its id is not reused
        if entry is None:
            return
        _, owners = entry
        for req in reversed(self.offload.loads_done(self.kv_cache_manager, so.kv_loads, owners, failed)):
            self.waiting.appendleft(req)

    # --- disaggregated serving (engine/kv_transfer/) ---------------------------------------

    def _release_waiting_holders(self) -> int:
        """Nothing runs and the head of the queue cannot get its blocks: they are held by waiting
        requests that came back from a load (a remote prefill, a peer's prefix, the offload tier;
        its KV arrived, or a failed load is recomputed) and wait behind the head. Those let go of
        their blocks (what a load published stays in the prefix cache, where they may hit it
        again) and compute their prompts when their turn comes, so that no request holds
        capacity that nobody can use. Returns how many let go."""
        released = 0
        for req in list(self.waiting)[1:]:
            if self._holds_blocks(req):
                self.kv_cache_manager.free(req)
                req.num_computed_tokens = 0
                released += 1
        self.num_holders_released += released
        return released

    def _holds_blocks(self, req: Request) -> bool:
        """A waiting request holds blocks only when it came back from a load (a remote prefill, a
        peer's prefix: its KV arrived, or a failed load is recomputed here): preemption and
        `_release_waiting_holders` free a request's blocks and a failed allocation leaves none."""
        return req.request_id in self.kv_cache_manager.req_to_blocks

    def take_kv_loads(self) -> list[KVLoadRequest]:
        """Remote prefills asked for since the last call (the caller performs them)."""
        return self.remote.take_loads()

    def remote_kv_target(self, request_id: str) -> list[int] | None:
        """The block ids a load's contents go to; None when the request is gone (aborted)."""
        return self.remote.target(request_id)

    def remote_kv_done(self, request_id: str, loaded: bool, error: str | None = None) -> None:
        """A load ended. `loaded`: its contents are in the blocks; else they are recomputed here,
        or with `error` the request fails with it."""
        req = self.remote.finish(request_id, loaded)
        if req is None:
            return
        self.stalled = False
        if not loaded and error is not None:
            req.status = RequestStatus.FINISHED_ERROR
            self._free_request(req)
            self._pending_outputs.append(
                EngineCoreOutput(request_id, [], finish_reason="error", error=error, error_kind="unavailable")
            )
            return
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)  # scheduled first, with the blocks it holds

    # --- results ----------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        mro = model_runner_output
        self._step_done(scheduler_output, set(mro.kv_load_failed))
        self.faults.step_ok(scheduler_output.num_scheduled_tokens)
        index = {rid: i for i, rid in enumerate(mro.request_ids)}
        for rid in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished, aborted or preempted since it was scheduled
            embedding = mro.embeddings.get(rid)
            if embedding is not None:  # an embedding request's prompt ended: it is done
                outputs.append(self._finish_embedding(req, embedding))
                continue
            i = index.get(rid)
            sampled = mro.sampled_token_ids[i] if i is not None else []
            logprobs = mro.logprobs[i] if i is not None and i < len(mro.logprobs) else None
            draft = scheduler_output.scheduled_spec_tokens.get(rid)
            if draft and sampled:
                self._verified(req, len(draft), len(sampled))
            new_tokens: list[int] = []
            stopped = False
            if sampled and req.num_computed_tokens >= req.num_tokens:
                for tok in sampled:
                    req.append_output_token_ids([tok])
                    new_tokens.append(tok)
                    if self._check_stop(req):
                        stopped = True
                        break
                if logprobs is not None:
                    logprobs = logprobs[: len(new_tokens)]
            prompt_lps = self._collect_prompt_logprobs(req, mro.prompt_logprobs.get(rid))
            if stopped:
                self.running.remove(req)
                self._free_request(req)
            if new_tokens or prompt_lps is not None or stopped:
                outputs.append(
                    EngineCoreOutput(
                        request_id=rid,
                        new_token_ids=new_tokens,
                        new_logprobs=logprobs if new_tokens else None,
                        prompt_logprobs=prompt_lps,
                        finish_reason=req.status.finish_reason if stopped else None,
                        stop_reason=req.stop_reason if stopped else None,
                        error=req.grammar.error if stopped and req.grammar is not None else None,
                        num_cached_tokens=max(req.num_cached_tokens, 0),
                        queue_time=(req.first_scheduled_time - req.arrival_time)
                        if new_tokens and req.num_output_tokens == len(new_tokens)
                        else None,
                    )
                )
        return outputs

    def _finish_embedding(self, req: Request, embedding: list[float]) -> EngineCoreOutput:
        """An embedding request ends at its prompt's end with no token; its blocks go back to the
        pool (the full ones stay in the prefix cache, as any request's do)."""
        req.status = RequestStatus.FINISHED_STOPPED
        self.running.remove(req)
        self._free_request(req)
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=[],
            finish_reason="stop",
            num_cached_tokens=max(req.num_cached_tokens, 0),
            queue_time=req.first_scheduled_time - req.arrival_time,
            embedding=embedding,
        )

    def _collect_prompt_logprobs(self, req: Request, chunk) -> list[TokenLogprob | None] | None:
        if req.sampling_params.prompt_logprobs is None:
            return None
        if chunk:
            self._prompt_logprobs.setdefault(req.request_id, []).extend(chunk)
        if req.num_computed_tokens >= req.num_prompt_tokens and req.request_id in self._prompt_logprobs:
            return self._prompt_logprobs.pop(req.request_id)
        return None

    def _check_stop(self, req: Request) -> bool:
        """Stop conditions after one appended token; sets status and stop_reason."""
        sp = req.sampling_params
        if req.grammar is not None:
            last = req.output_token_ids[-1]
            if not req.grammar.accept(last):  # masked out: never expected
                req.status = RequestStatus.FINISHED_ERROR
                return True
            # Once complete the grammar allows only an end token; it ends the request even
            # with ignore_eos (nothing may follow). Other ends stay tokens of the text.
            if req.grammar.is_stopped() and (last == req.eos_token_id or last in sp.stop_token_ids):
                req.status = RequestStatus.FINISHED_STOPPED
                return True
        if req.num_output_tokens >= sp.min_tokens:
            last = req.output_token_ids[-1]
            if not sp.ignore_eos and req.eos_token_id is not None and last == req.eos_token_id:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in sp.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = last
                return True
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    # --- metrics ----------------------------------------------------------------------------

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
