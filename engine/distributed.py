"""Tensor-parallel group state seen by the layers. tp=1 needs no torch.distributed at all.

The Ray side (workers/) creates the process group and calls `set_tp_group`; the engine only
uses the collectives below, so it never imports ray.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TPGroup:
    size: int = 1
    rank: int = 0
    group: object | None = None  # torch.distributed ProcessGroup when size > 1


_TP = TPGroup()


def get_tp_group() -> TPGroup:
    return _TP


def set_tp_group(size: int, rank: int, group: object | None = None) -> None:
    global _TP
    _TP = TPGroup(size=size, rank=rank, group=group)


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=_TP.group)
    return x


def tp_gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate each rank's last-dim shard on rank 0 (LM head); other ranks get None."""
    if _TP.size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP.size)] if _TP.rank == 0 else None
    dist.gather(x, parts, dst=dist.get_global_rank(_TP.group, 0) if _TP.group else 0, group=_TP.group)
    return torch.cat(parts, dim=-1) if _TP.rank == 0 else None


def tp_broadcast_object(obj: object, src: int = 0) -> object:
    if _TP.size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_TP.group)
    return box[0]
