"""A draft model as proposer: greedy tokens from a cheaper model with its own paged KV cache.

Per request the draft keeps a RunnerRequestState whose KV holds the request's verified tokens
plus the drafts it fed back last time. Each proposal first rolls that back to the longest
prefix still equal to the request's tokens (rejected drafts go; accepted ones are kept, since
their KV is the same), then runs k steps over all proposing requests at once: the first
computes the tokens the draft has not seen (the prompt, or the accepted drafts and the bonus
token) and every later one the draft it just produced. The draft is argmax, a point mass, so
verification (verify.py) stays exact rejection sampling.

Blocks come from the draft's own KVCacheManager and go back when the request finishes, is
aborted or preempted (`forget`), and past the kept prefix on rollback.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.core.kv_cache_manager import KVCacheManager
from engine.layers.sampler import argmax_rows
from engine.request import Request
from engine.runner.attn_metadata_builder import build_step_batch
from engine.runner.forward_context import forward_context
from engine.runner.model_runner import ModelRunner
from engine.runner.runner_state import RunnerRequestState
from engine.sampling_params import SamplingParams
from engine.spec_decode.draft_length import StepCostModel

_GREEDY = SamplingParams(temperature=0)


@dataclass
class _DraftSeq:
    state: RunnerRequestState  # prompt_token_ids: the request's own (live) token list
    blocks: Request  # the draft pool's handle for this request's blocks
    num_verified: int = 0  # leading tokens known to be the request's
    tail: list[int] = field(default_factory=list)  # drafts fed back after them (KV computed)


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, num_blocks: int, max_batch: int, max_k: int, measure: bool) -> None:
        self.runner = runner
        self.block_size = runner.cc.block_size
        runner.init_kv_cache(num_blocks)
        # The draft's step cost on this machine (rows x (1 + t) tokens), before any request.
        self.step_cost = StepCostModel(runner.measure_step_costs(max_batch, max_k)) if measure else None
        self.kv = KVCacheManager(self.block_size, num_blocks, enable_prefix_caching=False)
        self._seqs: dict[str, _DraftSeq] = {}
        self.seconds = 0.0  # time spent proposing (all requests)

    def pending_tokens(self, request_id: str, num_tokens: int) -> int:
        """Tokens the draft's first step would compute for this request (at least 1)."""
        seq = self._seqs.get(request_id)
        return num_tokens - seq.state.num_computed_tokens if seq else num_tokens

    def _sync(self, request_id: str, tokens: list[int]) -> _DraftSeq:
        """The request's draft state, its KV cut back to the prefix still equal to `tokens`."""
        seq = self._seqs.get(request_id)
        if seq is None:
            state = RunnerRequestState(request_id, tokens, [], _GREEDY, [], 0)
            seq = self._seqs[request_id] = _DraftSeq(state, Request(request_id, [], _GREEDY))
        st = seq.state
        keep = seq.num_verified
        for d in seq.tail:
            if keep >= len(tokens) or tokens[keep] != d:
                break
            keep += 1
        # The last token is always (re)computed: its logits give the first draft.
        keep = min(keep, st.num_computed_tokens, len(tokens) - 1)
        if keep < st.num_computed_tokens:
            seq.blocks.num_computed_tokens = keep
            kept = self.kv.trim(seq.blocks, keep)
            if kept is not None:
                del st.block_ids[kept:]
            st.num_computed_tokens = keep
        st.prompt_token_ids, st.spec_token_ids = tokens, []
        seq.num_verified, seq.tail = len(tokens), []
        return seq

    @torch.inference_mode()
    def propose_batch(self, items: Sequence[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        """(request id, its token ids so far, k) -> k greedy draft tokens (fewer: none, when
        the draft pool has no room for that request)."""
        t0 = time.perf_counter()
        active: list[tuple[_DraftSeq, int, int]] = []  # (seq, first step's tokens, k)
        for rid, tokens, k in items:
            seq = self._sync(rid, tokens)
            n = len(tokens) - seq.state.num_computed_tokens
            seq.blocks.num_computed_tokens = seq.state.num_computed_tokens
            new = self.kv.allocate_slots(seq.blocks, n + k - 1)  # KV for all but the last draft
            if new is not None:
                seq.state.block_ids.extend(new)
                active.append((seq, n, k))
        out: dict[str, list[int]] = {}
        model, first = self.runner.model, True
        while active:
            states = [s.state for s, _, _ in active]
            counts = [n if first else 1 for _, n, _ in active]
            batch = build_step_batch(
                states, counts, self.block_size, self.runner.device, decode_buckets=self.runner.uses_decode_buckets
            )
            with forward_context(batch.meta):
                hidden = model(batch.input_ids, batch.positions)
            tokens = dict(zip(batch.request_ids, argmax_rows(model.compute_logits(hidden[batch.last_rows])).tolist()))
            for (seq, _, _), n in zip(active, counts):
                seq.state.num_computed_tokens += n
                seq.state.spec_token_ids.append(tokens[seq.state.request_id])
            first = False
            done = [(s, n, k) for s, n, k in active if len(s.state.spec_token_ids) >= k]
            active = [(s, n, k) for s, n, k in active if len(s.state.spec_token_ids) < k]
            for seq, _, k in done:
                drafts = seq.state.spec_token_ids
                out[seq.state.request_id] = list(drafts)
                seq.tail = drafts[: k - 1]  # fed back, so in the KV; the last one is not
        self.seconds += time.perf_counter() - t0
        return out

    def forget(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq.blocks)

    def num_blocks_used(self) -> int:
        return self.kv.block_pool.get_num_used_blocks()

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        assert set(self.kv.req_to_blocks) <= set(self._seqs)
