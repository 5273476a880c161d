"""Embeddings from the step's hidden states: a decoder model run as an embedder.

An embedding request (`SamplingParams.pooling`) is a prefill that samples nothing. Its vector is
made from the final-norm hidden states (the rows the LM head would read), pooled over its prompt
and L2-normalised: "last" takes the last prompt token's row, "mean" the mean of every prompt
position's row. A prompt may run in several chunks: mean pooling keeps a float32 running sum in
the request's runner state and divides at the prompt's end (the scheduler gives such a request
no prefix-cache hits, so every position passes through here). At tp > 1 the hidden states are
whole on every rank after the last all-reduce; rank 0's are the ones returned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.runner.attn_metadata_builder import StepBatch
    from engine.runner.runner_state import RunnerRequestState


def pool_step(hidden: torch.Tensor, batch: StepBatch, by_id: dict[str, RunnerRequestState]) -> dict[str, torch.Tensor]:
    """The normalised float32 vectors of the embedding requests whose prompt ends this step
    (on the hidden states' device), request id -> [hidden]. Call before the requests'
    `num_computed_tokens` advance past this step's tokens."""
    done: dict[str, torch.Tensor] = {}
    for k, rid in enumerate(batch.request_ids):
        st = by_id[rid]
        mode = st.sampling_params.pooling
        if mode is None:
            continue
        n, last = batch.counts[k], batch.last_rows[k]
        ends = st.num_computed_tokens + n >= len(st.prompt_token_ids)
        if mode == "mean":
            chunk = hidden[last - n + 1 : last + 1].float().sum(dim=0)  # a request's rows are consecutive
            st.pooled_sum = chunk if st.pooled_sum is None else st.pooled_sum + chunk
            if ends:
                done[rid] = F.normalize(st.pooled_sum / len(st.prompt_token_ids), dim=-1)
        elif ends:
            done[rid] = F.normalize(hidden[last].float(), dim=-1)
    return done
