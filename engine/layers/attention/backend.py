"""The attention backend interface (the choice among backends is `selector.py`).

A backend writes the new tokens' K/V into the paged cache and computes attention for a
mixed batch of decode tokens and prefill chunks. Fast kernels (the C++ CPU ops, the Triton
CUDA kernel) override `decode`/`prefill` of the reference; they are optional imports and are
tested against the reference backend.
"""

from __future__ import annotations

import abc

import torch

from engine.layers.attention.metadata import AttentionMetadata


class AttentionBackend(abc.ABC):
    name: str = "abstract"
    # Whether the metadata must carry padded decode buckets (gather-based decode).
    uses_decode_buckets: bool = True

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, Hkv, num_blocks, block_size, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...
