"""Text side of the engine: EngineCoreOutputs (token ids) -> RequestOutputs (text, deltas).

One user request with n > 1 is n child sequences in the core (the front end picks their ids);
this processor keeps one detokenizer and stop checker per child and aggregates children into
one RequestOutput (outputs[index]). Stop strings are found here, not in the core: a child that
hits one is returned in `stop_ids` so the caller finishes it in the scheduler (frees its KV).

Token ids end at the token that completes a stop string (a step with several tokens, from
speculative decoding, is checked token by token); the text is truncated at the stop string.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.outputs import CompletionOutput, EngineCoreOutput, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.stop_checker import StopChecker

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class _ChildState:
    index: int
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    text: str = ""  # final text so far (a matched stop string already cut off)
    num_streamed_chars: int = 0  # text[:num_streamed_chars] has been handed out as deltas
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Per-call delta (reset each process_outputs call that touches the parent).
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[TokenLogprob] | None = None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[_ChildState]
    child_ids: list[str]
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    error_kind: str = "invalid"
    metrics: dict = field(default_factory=dict)
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._child_to_parent: dict[str, tuple[_RequestState, _ChildState]] = {}
        self._token_text: dict[int, str] = {}  # decoded single tokens, for logprobs

    def __len__(self) -> int:
        return len(self._requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_ids: list[str] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        child_ids = list(child_ids) if child_ids else [request_id]
        if request_id in self._requests or any(c in self._child_to_parent for c in child_ids):
            raise ValueError(f"request id {request_id!r} (or one of its children) already exists")
        children = [
            _ChildState(
                index=i,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens),
                stop_checker=StopChecker(params.stop, params.include_stop_str_in_output),
                logprobs=[] if params.logprobs is not None else None,
            )
            for i in range(len(child_ids))
        ]
        state = _RequestState(request_id, prompt, list(prompt_token_ids), params, children, child_ids)
        state.metrics["arrival_time"] = time.monotonic() if arrival_time is None else arrival_time
        self._requests[request_id] = state
        for cid, child in zip(child_ids, children):
            self._child_to_parent[cid] = (state, child)

    def abort_request(self, request_id: str) -> list[str]:
        """Drop a request (or the parent of a child id); returns the child ids to abort in the
        core."""
        if request_id not in self._requests and request_id in self._child_to_parent:
            request_id = self._child_to_parent[request_id][0].request_id
        state = self._requests.pop(request_id, None)
        if state is None:
            return []
        for cid in state.child_ids:
            self._child_to_parent.pop(cid, None)
        return list(state.child_ids)

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        now = time.monotonic()
        touched: dict[str, _RequestState] = {}
        stop_ids: list[str] = []
        for out in core_outputs:
            entry = self._child_to_parent.get(out.request_id)
            if entry is None:
                continue  # aborted, or already finished by a stop string: late tokens dropped
            state, child = entry
            if state.request_id not in touched:
                touched[state.request_id] = state
                for c in state.children:
                    c.token_ids_delta, c.logprobs_delta = [], None
            if child.finish_reason is not None:
                continue
            if self._process_one(state, child, out, now) and not out.finished:
                stop_ids.append(out.request_id)

        results = []
        for state in touched.values():
            if state.finished:
                state.metrics["finished_time"] = now
            results.append(self._make_output(state))
            if state.finished:
                self.abort_request(state.request_id)  # drop state; nothing to abort in the core
        return results, stop_ids

    def _process_one(self, state: _RequestState, child: _ChildState, out: EngineCoreOutput, now: float) -> bool:
        """Update one child; True when a stop string finished it."""
        params = state.params
        m = state.metrics
        if out.new_token_ids:
            m.setdefault("first_token_time", now)
            m["last_token_time"] = now
        if out.num_cached_tokens:
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = [self._decorate(lp) for lp in out.prompt_logprobs]
        if out.error is not None:
            state.error, state.error_kind = out.error, out.error_kind
        if out.embedding is not None:
            state.embedding = out.embedding

        ids, lps = list(out.new_token_ids), out.new_logprobs or []
        if len(ids) > 1 and child.stop_checker:
            # Several tokens in one step (speculative decoding): look for stop strings after each
            # one, as one token per step would, so no token past the match enters the output.
            for j in range(len(ids)):
                last = j == len(ids) - 1
                if self._add_tokens(params, child, ids[j : j + 1], lps[j : j + 1], out if last else None):
                    return True
            return False
        return self._add_tokens(params, child, ids, lps, out)

    def _add_tokens(
        self,
        params: SamplingParams,
        child: _ChildState,
        new_ids: list[int],
        new_lps: list,
        out: EngineCoreOutput | None,
    ) -> bool:
        """Append tokens to a child; `out` when they end the step's output (its finish reason
        applies to the last of them). True when a stop string finished it."""
        child.token_ids.extend(new_ids)
        child.token_ids_delta.extend(new_ids)
        if child.logprobs is not None and new_lps:
            decorated = [self._decorate(lp) for lp in new_lps]
            child.logprobs.extend(decorated)
            child.logprobs_delta = (child.logprobs_delta or []) + decorated

        finished = out is not None and out.finished
        # The core stopped on EOS / a stop token id: its text is not part of the output.
        text_ids = new_ids
        if finished and out.finish_reason == "stop" and not params.include_stop_str_in_output and new_ids:
            text_ids = new_ids[:-1]
        new_text = child.detokenizer.add(text_ids)
        if finished:
            new_text += child.detokenizer.flush()
        child.text += new_text

        stopped = False
        if child.stop_checker and len(child.token_ids) > params.min_tokens:
            match = child.stop_checker.find(child.text, len(new_text))
            if match is not None:
                stop_str, cut = match
                child.text = child.text[:cut]
                child.finish_reason, child.stop_reason = "stop", stop_str
                stopped = True
        if not stopped and finished:
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
        return stopped

    def _make_output(self, state: _RequestState) -> RequestOutput:
        outputs = []
        for c in state.children:
            # Stream up to what can no longer become part of a stop string.
            end = len(c.text)
            if c.finish_reason is None and c.stop_checker:
                end = max(c.num_streamed_chars, end - c.stop_checker.hold_back(c.text))
            delta = c.text[c.num_streamed_chars : end]
            c.num_streamed_chars = end
            outputs.append(
                CompletionOutput(
                    index=c.index,
                    text=c.text[:end],
                    # The child's own growing list, as `logprobs`: copying it every step cost
                    # O(output) per step. A consumer that keeps an output past the next one copies it.
                    token_ids=c.token_ids,
                    logprobs=c.logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    text_delta=delta,
                    token_ids_delta=c.token_ids_delta,
                    logprobs_delta=c.logprobs_delta,
                )
            )
        out = RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=state.finished,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            metrics=dict(state.metrics),
            embedding=state.embedding,
        )
        if state.error is not None:
            out.error, out.error_kind = state.error, state.error_kind
            out.metrics["error"] = state.error
        return out

    def _decorate(self, lp: TokenLogprob | None) -> TokenLogprob | None:
        """Fill the decoded strings of a logprob entry (single-token decodes, cached)."""
        if lp is None:
            return None
        lp.decoded = self.token_text(lp.token_id)
        lp.top_decoded = [self.token_text(t) for t, _ in lp.top]
        return lp

    def token_text(self, token_id: int) -> str:
        s = self._token_text.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = s
        return s
