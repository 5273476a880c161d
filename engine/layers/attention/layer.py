"""The attention layer: holds its KV cache view and calls the step's backend."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.attention.backend import AttentionBackend
from engine.layers.attention.selector import get_backend
from engine.runner.forward_context import get_attn_metadata


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, backend: AttentionBackend | None = None
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        self.backend = backend or get_backend()
        self.kv_cache: torch.Tensor | None = None  # bound by the model runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_attn_metadata()
        if meta is None or self.kv_cache is None:
            raise RuntimeError("Attention called outside a model-runner step (no metadata or KV cache)")
        t = q.shape[0]
        out = self.backend.forward(
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            meta,
            self.scale,
        )
        return out.view(t, self.num_heads * self.head_dim)
