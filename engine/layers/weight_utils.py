"""Shard-aware weight slicing that works on tensors and on lazy safetensors slices.

Passing a safetensors `PySafeSlice` lets each TP rank read only its own rows/columns
from disk, so a rank's memory is ~1/tp of the weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.layers.quant.blocks import BlockQuantized

if TYPE_CHECKING:
    from typing import Protocol

    class LazySlice(Protocol):
        """A safetensors `PySafeSlice` (from `safe_open(...).get_slice`): its shape without
        reading, and indexing reads only the selected part."""

        def get_shape(self) -> list[int]: ...

        def __getitem__(self, idx: Any) -> torch.Tensor: ...

    Weight = torch.Tensor | LazySlice | BlockQuantized  # a checkpoint tensor, loaded or lazy, or GGUF blocks


def shape_of(w: Weight) -> tuple[int, ...]:
    return tuple(w.shape) if isinstance(w, (torch.Tensor, BlockQuantized)) else tuple(w.get_shape())


def narrow(w: Weight, dim: int, start: int, length: int) -> torch.Tensor | BlockQuantized:
    if isinstance(w, (torch.Tensor, BlockQuantized)):
        return w.narrow(dim, start, length)
    idx = [slice(None)] * len(shape_of(w))
    idx[dim] = slice(start, start + length)
    return w[tuple(idx)]


def materialize(w: Weight) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w[:]


def copy_rows_into(param: torch.Tensor, offset: int, w: Weight) -> None:
    """Rows [offset, offset + len(w)) of `param` from `w`. GGUF blocks are not turned into floats:
    they wait on the parameter (`.block_parts`) until the layer packs them (quant/apply.py)."""
    if isinstance(w, BlockQuantized):
        n, k = w.shape
        if k != param.shape[1] or offset + n > param.shape[0]:
            raise ValueError(f"weight shape {w.shape} does not fit parameter {tuple(param.shape)} at row {offset}")
        param.__dict__.setdefault("block_parts", []).append((offset, w))
        return
    # Float rows beside blocks in one fused parameter (a GGUF's q in F16, its k and v quantized):
    # quant/apply.py then keeps the whole parameter in float.
    param.__dict__["has_float_rows"] = True
    copy_into(param.data.narrow(0, offset, shape_of(w)[0]), w)


def copy_into(param: torch.Tensor, w: Weight) -> None:
    if isinstance(w, BlockQuantized):
        if w.shape[0] != param.shape[0]:
            raise ValueError(f"weight shape {w.shape} does not match parameter {tuple(param.shape)}")
        return copy_rows_into(param, 0, w)
    w = materialize(w)
    if tuple(param.shape) != tuple(w.shape):
        raise ValueError(f"weight shape {tuple(w.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(w.to(param.dtype))


def default_weight_loader(param: torch.Tensor, w: Weight) -> None:
    copy_into(param, w)
