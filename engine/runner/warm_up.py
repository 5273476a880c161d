"""Warm-up before serving: each linear kernel runs once at every row count it will meet.

oneDNN builds a kernel per (weight shape, row count) the first time it sees one (packed_gemm.py
rounds row counts to row_bucket's values so a serving run meets ~50), and the first requests
after a start (a freshly autoscaled replica's first users) pay for those builds in their
time to first token. So before the engine takes requests, every distinct weight (by kind, shape
and layout: one instance stands for all layers alike) computes zeros at every bucket a prompt
chunk or a decode step can take, and the LM head at every bucket of rows it can score at once.
Row counts stop at WARM_ROWS: a kernel build costs ~1 ms whatever the rows (bf16 and float32,
2-core Zen 4), while a linear over more rows computes for several ms itself, so larger
buckets would cost the warm-up more than they save a request. The weights' values are not
touched. At tp > 1 every rank runs it at once (the LM head gathers its logits over the ranks),
each on its own shards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.packed_gemm import linear, row_bucket
from engine.layers.vocab_embedding import ParallelLMHead

WARM_ROWS = 512


@dataclass
class WarmUpReport:
    shapes: int  # (weight, row count) pairs run
    seconds: float


def row_counts(max_rows: int) -> list[int]:
    """Every row count a GEMM runs with for 1..max_rows rows (row_bucket's values)."""
    counts, m = [], 1
    while m <= max_rows:
        b = row_bucket(m)
        counts.append(b)
        m = b + 1
    return counts


def _key(w: torch.Tensor) -> tuple:
    """What a kernel is built for: the weight's kind, shape and layout, not its values."""
    attrs = ("group_size", "two_nibbles", "out_features")
    five = getattr(w, "hi_bits", None) is not None  # the 5-bit kernels are other builds
    return (type(w), w.dtype, tuple(w.shape), w.is_mkldnn, w.device, five) + tuple(getattr(w, a, None) for a in attrs)


def distinct_linears(model: nn.Module) -> list[tuple[torch.Tensor, int]]:
    """(weight, input features) of one linear per distinct weight kind and shape."""
    seen: dict[tuple, tuple[torch.Tensor, int]] = {}
    for mod in model.modules():
        if isinstance(mod, ColumnParallelLinear):
            w, k = mod.weight, mod.input_size
        elif isinstance(mod, RowParallelLinear):
            w, k = mod.weight, mod.input_size_per_partition
        else:
            continue
        seen.setdefault(_key(w), (w, k))
    return list(seen.values())


@torch.inference_mode()
def warm_up(
    model: nn.Module, hidden_size: int, dtype: torch.dtype, device: torch.device, max_tokens: int, max_logit_rows: int
) -> WarmUpReport:
    """Run every distinct linear at every row bucket up to `max_tokens` (a step's tokens) and the
    LM head (of `hidden_size` inputs) up to `max_logit_rows` (the rows a step scores), both at
    most WARM_ROWS."""
    t0, shapes = time.perf_counter(), 0
    for w, k in distinct_linears(model):
        for m in row_counts(min(max_tokens, WARM_ROWS)):
            linear(torch.zeros(m, k, dtype=dtype, device=device), w)
            shapes += 1
    head = next((mod for mod in model.modules() if isinstance(mod, ParallelLMHead)), None)
    if head is not None:
        for m in row_counts(min(max_logit_rows, WARM_ROWS)):
            head.compute_logits(torch.zeros(m, hidden_size, dtype=dtype, device=device))
            shapes += 1
    return WarmUpReport(shapes, time.perf_counter() - t0)
