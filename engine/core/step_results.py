"""A step's results into the requests: sampled tokens appended, stop conditions applied,
prompt logprobs gathered across chunks, embeddings finished; the outputs to hand out."""

from __future__ import annotations

from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.outputs import EngineCoreOutput, TokenLogprob
from engine.request import Request, RequestStatus


class StepResults:
    """A part of `Scheduler` (engine/core/scheduler.py), which holds the state it works on."""

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
