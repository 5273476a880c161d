"""Shard-aware weight slicing that works on tensors and on lazy safetensors slices.

Passing a safetensors `PySafeSlice` lets each TP rank read only its own rows/columns
from disk, so a rank's memory is ~1/tp of the weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from typing import Protocol

    class LazySlice(Protocol):
        """A safetensors `PySafeSlice` (from `safe_open(...).get_slice`): its shape without
        reading, and indexing reads only the selected part."""

        def get_shape(self) -> list[int]: ...

        def __getitem__(self, idx: Any) -> torch.Tensor: ...

    Weight = torch.Tensor | LazySlice  # a checkpoint tensor, loaded or lazy


def shape_of(w: Weight) -> tuple[int, ...]:
    return tuple(w.shape) if isinstance(w, torch.Tensor) else tuple(w.get_shape())


def narrow(w: Weight, dim: int, start: int, length: int) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return w.narrow(dim, start, length)
    idx = [slice(None)] * len(shape_of(w))
    idx[dim] = slice(start, start + length)
    return w[tuple(idx)]


def materialize(w: Weight) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w[:]


def copy_into(param: torch.Tensor, w: Weight) -> None:
    w = materialize(w)
    if tuple(param.shape) != tuple(w.shape):
        raise ValueError(f"weight shape {tuple(w.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(w.to(param.dtype))


def default_weight_loader(param: torch.Tensor, w: Weight) -> None:
    copy_into(param, w)
