"""Tensor-parallel group state seen by the layers. tp=1 needs no torch.distributed at all.

The Ray side (workers/) creates the process group; the engine only uses the collectives
below, so it never imports ray. A remote rank (one per process) sets its group for the whole
process with `set_tp_group`; rank 0 runs inside the driver, where several engines may live
(each with its own group, stepped from any thread), so it binds its group only around its own
work with `bound_tp_group`.

Groups are constructed directly (not registered as torch's default/world group), so the
collectives call the group object itself where torch's helpers would need the registry.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from engine.pipeline_group import PPGroup


@dataclass
class TPGroup:
    size: int = 1
    rank: int = 0
    group: object | None = None  # a torch.distributed ProcessGroup/Backend when size > 1


_TP = TPGroup()
_PP = PPGroup()
_BOUND = threading.local()  # per-thread override: rank 0 in the driver


def get_tp_group() -> TPGroup:
    return getattr(_BOUND, "tp", None) or _TP


def get_pp_group() -> PPGroup:
    """This rank's pipeline stage (engine/pipeline.py); one stage when pp=1."""
    return getattr(_BOUND, "pp", None) or _PP


def set_tp_group(size: int, rank: int, group: object | None = None, pp: PPGroup | None = None) -> None:
    global _TP, _PP
    _TP = TPGroup(size=size, rank=rank, group=group)
    _PP = pp or PPGroup()


@contextmanager
def bound_tp_group(tp: TPGroup, pp: PPGroup | None = None) -> Iterator[TPGroup]:
    """Use `tp` (and `pp`; None keeps the bound one) on this thread for the duration (model
    loading and each step of rank 0)."""
    prev, prev_pp = getattr(_BOUND, "tp", None), getattr(_BOUND, "pp", None)
    _BOUND.tp, _BOUND.pp = tp, pp if pp is not None else prev_pp
    try:
        yield tp
    finally:
        _BOUND.tp, _BOUND.pp = prev, prev_pp


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    tp = get_tp_group()
    if tp.size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=tp.group)
    return x


def tp_max(value: float) -> float:
    """The largest of every rank's `value` (a step takes as long as its slowest rank)."""
    tp = get_tp_group()
    if tp.size == 1:
        return value
    import torch.distributed as dist

    x = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=tp.group)
    return float(x.item())


def tp_gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate each rank's last-dim shard on rank 0 (LM head); other ranks get None."""
    tp = get_tp_group()
    if tp.size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    opts = dist.GatherOptions()
    opts.rootRank = 0
    if tp.rank == 0:
        parts = [torch.empty_like(x) for _ in range(tp.size)]
        tp.group.gather([parts], [x], opts).wait()
        return torch.cat(parts, dim=-1)
    tp.group.gather([], [x], opts).wait()
    return None
