"""Rows of a fused checkpoint tensor (Phi-3's `qkv_proj`, `gate_up_proj`) as a weight of their
own, still lazy: a rank's loader narrows it to the rows it keeps, and only those are read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.layers.weight_utils import Weight


class RowWindow:
    """Rows [offset, offset + rows) of a lazy safetensors slice, indexed like one."""

    def __init__(self, w: Weight, offset: int, rows: int) -> None:
        self.w, self.offset, self.rows = w, offset, rows
        self.shape = [rows, *list(w.get_shape())[1:]]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, idx: Any) -> torch.Tensor:
        idx = idx if isinstance(idx, tuple) else (idx,)
        first = idx[0] if idx else slice(None)
        start, stop, step = first.indices(self.rows)
        if step != 1:
            raise ValueError("a fused tensor's rows are read in one contiguous range")
        return self.w[(slice(self.offset + start, self.offset + stop), *idx[1:])]


def row_window(w: Weight, offset: int, rows: int) -> RowWindow | torch.Tensor:
    """Rows [offset, offset + rows) of `w`: a view of a tensor, a RowWindow of a lazy slice."""
    if isinstance(w, torch.Tensor):
        return w.narrow(0, offset, rows)
    if not hasattr(w, "get_shape"):
        raise ValueError(f"a fused checkpoint tensor of type {type(w).__name__} cannot be split")
    return RowWindow(w, offset, rows)
