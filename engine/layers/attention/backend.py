"""The attention backend interface and the choice of backend at start-up.

A backend writes the new tokens' K/V into the paged cache and computes attention for a
mixed batch of decode tokens and prefill chunks. Fast kernels (flash-attn, FlashInfer)
join by implementing `forward`; they are optional imports and are tested against the
reference backend.
"""
from __future__ import annotations

import abc

import torch

from engine.layers.attention.metadata import AttentionMetadata


class AttentionBackend(abc.ABC):
    name: str = "abstract"

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


def get_backend(name: str = "auto") -> AttentionBackend:
    from engine.layers.attention.reference import ReferenceAttentionBackend

    if name in ("auto", "reference", "torch"):
        return ReferenceAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: reference")
