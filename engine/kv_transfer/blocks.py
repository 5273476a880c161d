"""The KV payload moved between engines: whole blocks, all layers, every KV head.

Always every KV head, whatever either side's tensor-parallel degree: the sender gathers its
ranks' head slices, the receiver cuts out each rank's slice, so prefill tp=1 feeds decode tp=3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import InvalidRequestError
from engine.layers.attention.kv_quant import is_quantized_cache, storage_row_width


@dataclass(frozen=True)
class KVLayout:
    """What both sides must agree on before block contents can move."""

    num_layers: int
    num_kv_heads: int  # all of the model's, not one rank's
    head_dim: int
    block_size: int
    dtype: str  # the cache's torch dtype name, e.g. "float32"; "int8"/"float8_e4m3fn": rows carry their scales

    @property
    def row_width(self) -> int:
        return storage_row_width(getattr(torch, self.dtype), self.head_dim)

    def check_matches(self, other: KVLayout) -> None:
        if self != other:
            raise InvalidRequestError(f"KV layouts differ between prefill and decode: {other} vs {self}")

    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.row_width * elem


@dataclass
class KVBlocks:
    """Blocks `first_block ..` of one sequence's block table holding its tokens up to
    `num_tokens` (the last block may be partial). `data`: (layers, 2, kv heads, blocks,
    block_size, head_dim), the cache's own layout with the layers stacked in front."""

    layout: KVLayout
    first_block: int
    num_tokens: int
    data: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.data.shape[3]

    # PyTorch cannot unpickle a float8 tensor (its storage has no dtype): a quantized payload
    # travels as its bytes and is viewed back on arrival.
    def __getstate__(self) -> dict:
        data = self.data.view(torch.uint8) if is_quantized_cache(self.data.dtype) else self.data
        return {**self.__dict__, "data": data, "dtype": self.data.dtype}

    def __setstate__(self, state: dict) -> None:
        dtype = state.pop("dtype")
        self.__dict__.update(state)
        self.data = self.data.view(dtype)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def check(self, layout: KVLayout, num_blocks: int) -> None:
        """Raise a clear error unless this payload fits `num_blocks` blocks of `layout`."""
        layout.check_matches(self.layout)
        want = (layout.num_layers, 2, layout.num_kv_heads, num_blocks, layout.block_size, layout.row_width)
        if tuple(self.data.shape) != want:
            raise InvalidRequestError(f"KV payload has shape {tuple(self.data.shape)}, expected {want}")
