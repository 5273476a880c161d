"""The attention backend interface and the choice of backend at start-up.

A backend writes the new tokens' K/V into the paged cache and computes attention for a
mixed batch of decode tokens and prefill chunks. Fast kernels (flash-attn, FlashInfer)
join by implementing `forward`; they are optional imports and are tested against the
reference backend.
"""
from __future__ import annotations

import abc
import os

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


_INSTANCES: dict[str, AttentionBackend] = {}


def get_backend(name: str | None = None) -> AttentionBackend:
    """`auto`: the C++ paged kernel on CPU when it builds, else the PyTorch reference.
    Set ORBITAL_ATTENTION_BACKEND=reference|cpu_paged to force one."""
    name = name or os.environ.get("ORBITAL_ATTENTION_BACKEND", "auto")
    if name == "auto" and torch.get_default_device().type != "cpu":
        name = "reference"  # the C++ kernel is CPU-only; CUDA kernels join here when added
    if name not in _INSTANCES:
        _INSTANCES[name] = _make(name)
    return _INSTANCES[name]


def _make(name: str) -> AttentionBackend:
    from engine.layers.attention.reference import ReferenceAttentionBackend

    if name in ("reference", "torch"):
        return ReferenceAttentionBackend()
    if name in ("auto", "cpu_paged"):
        from engine.layers.attention.cpu_paged import CpuPagedAttentionBackend, kernel_available

        if kernel_available():
            return CpuPagedAttentionBackend()
        if name == "cpu_paged":
            raise RuntimeError("the cpu_paged attention backend could not be built (needs a C++ compiler and ninja)")
        return ReferenceAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: auto, reference, cpu_paged")
