"""Build the step's token batch and attention metadata from the runner's request states.

Decode rows (one new token) come first, grouped by context length into a few buckets so
the padded gather stays close to the real context; prefill chunks follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.layers.attention.metadata import AttentionMetadata, DecodeBucket, PrefillChunk
from engine.runner.runner_state import RunnerRequestState

_BUCKET_OVERHEAD_BLOCKS = 48  # cost of one extra SDPA call, in padded blocks
_MAX_BUCKETS = 4


@dataclass
class StepBatch:
    request_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    last_rows: list[int]  # row of each request's last scheduled token
    starts: list[int]  # first row of each request
    counts: list[int]  # scheduled tokens of each request


def _split_buckets(blocks: list[int]) -> list[tuple[int, int]]:
    """Partition a sorted list into <= _MAX_BUCKETS runs minimising padded blocks + overhead.

    Only boundaries between distinct values can be optimal splits (moving a split inside a run
    of equal values to the run's edge never costs more), so the dynamic programme runs over
    groups of equal values, one vectorised min per bucket: O(buckets x groups^2) in numpy where
    the exhaustive search over rows was O(buckets x rows^2) Python (~17 ms at 256 rows here)."""
    vals, counts = np.unique(np.asarray(blocks, dtype=np.int64), return_counts=True)
    m = len(vals)
    ends = np.cumsum(counts)
    starts = ends - counts
    first, last = np.arange(m)[:, None], np.arange(m)[None, :]
    # run[a, c]: one bucket over groups a..c, padded to group c's value.
    run = np.where(
        first <= last,
        (ends[None, :] - starts[:, None]) * vals[None, :].astype(np.float64) + _BUCKET_OVERHEAD_BLOCKS,
        np.inf,
    )
    best = np.full(m + 1, np.inf)  # best[a]: cost of groups before a in k buckets
    best[0] = 0.0
    bests, prevs = [best], []
    for _ in range(_MAX_BUCKETS):
        total = bests[-1][:m, None] + run
        arg = total.argmin(axis=0)  # the first minimum: lowest split on ties
        bests.append(np.concatenate(([np.inf], total[arg, np.arange(m)])))
        prevs.append(arg)
    k = int(np.argmin([bb[m] for bb in bests[1:]])) + 1
    runs, c = [], m
    while k > 0:
        a = int(prevs[k - 1][c - 1])
        runs.append((int(starts[a]), int(ends[c - 1])))
        c, k = a, k - 1
    return runs[::-1]


def build_step_batch(
    states: list[RunnerRequestState],
    counts: list[int],
    block_size: int,
    device: torch.device | str,
    decode_buckets: bool = True,
) -> StepBatch:
    bs = block_size
    decode = sorted((i for i, n in enumerate(counts) if n == 1), key=lambda i: states[i].num_computed_tokens)
    prefill = [i for i, n in enumerate(counts) if n > 1]
    order = decode + prefill
    ids, pos, slots = [], [], []
    starts, last_rows = [], []
    for i in order:
        st, n = states[i], counts[i]
        nc = st.num_computed_tokens
        starts.append(len(ids))
        ids.extend(st.token_slice(nc, nc + n))
        pos.extend(range(nc, nc + n))
        slots.extend(st.block_ids[p // bs] * bs + p % bs for p in range(nc, nc + n))
        last_rows.append(len(ids) - 1)
    meta = AttentionMetadata(
        block_size=bs, slot_mapping=torch.tensor(slots, dtype=torch.long, device=device), num_decode_tokens=len(decode)
    )
    if decode:
        nblocks = [(states[i].num_computed_tokens + bs) // bs for i in decode]
        maxb = nblocks[-1]
        meta.decode_block_table = torch.tensor(
            [states[i].block_ids[:maxb] + [0] * (maxb - min(maxb, len(states[i].block_ids))) for i in decode],
            dtype=torch.int32,
            device=device,
        )
        meta.decode_seq_lens = torch.tensor(
            [states[i].num_computed_tokens + 1 for i in decode], dtype=torch.int32, device=device
        )
        for a, b in _split_buckets(nblocks) if decode_buckets else []:
            maxb = nblocks[b - 1]
            flat = []
            for i in decode[a:b]:
                blk = states[i].block_ids[:maxb]
                flat.extend(blk + [0] * (maxb - len(blk)))
            seq = torch.tensor([states[i].num_computed_tokens + 1 for i in decode[a:b]], device=device)
            mask = torch.arange(maxb * bs, device=device)[None, :] < seq[:, None]
            meta.decode_buckets.append(
                DecodeBucket(a, b, torch.tensor(flat, dtype=torch.long, device=device), maxb, mask[:, None, :])
            )
    tables, info = [], []
    for k, i in enumerate(prefill, start=len(decode)):
        st, n = states[i], counts[i]
        nc = st.num_computed_tokens
        blocks = st.block_ids[: -(-(nc + n) // bs)]
        mask = None
        if nc > 0:
            q = torch.arange(n, device=device)[:, None] + nc
            mask = torch.arange(nc + n, device=device)[None, :] <= q
        meta.prefills.append(
            PrefillChunk(starts[k], n, nc, torch.tensor(blocks, dtype=torch.long, device=device), mask)
        )
        tables.append(blocks)
        info.append([starts[k], n, nc])
    if prefill:
        maxb = max(len(t) for t in tables)
        meta.prefill_block_table = torch.tensor(
            [t + [0] * (maxb - len(t)) for t in tables], dtype=torch.int32, device=device
        )
        meta.prefill_info = torch.tensor(info, dtype=torch.int32, device=device)
        meta.prefill_max_new = max(n for _, n, _ in info)
    return StepBatch(
        request_ids=[states[i].request_id for i in order],
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        meta=meta,
        last_rows=last_rows,
        starts=starts,
        counts=[counts[i] for i in order],
    )
