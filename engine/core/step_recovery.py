"""The scheduler's side of a failed step (engine/core/step_faults.py says who is suspected):
roll back the requests a failed step ran, fail its culprit or quarantine the suspects, and drop
the results of the steps launched after it."""

from __future__ import annotations

import logging

from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.outputs import EngineCoreOutput
from engine.request import RequestStatus

log = logging.getLogger(__name__)


class StepRecovery:
    """A part of `Scheduler` (engine/core/scheduler.py), which holds the state it works on."""

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
