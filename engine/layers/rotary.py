"""Rotary position embedding (neox / HF "rotate_half" layout) with default, linear and
llama3 frequency scaling, cached as cos/sin tables indexed by absolute position. Partial
rotary (Phi-3's `partial_rotary_factor` < 1) rotates the first `rotary_dim` of each head and
passes the rest through."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.kernels.cpu_ops import cpu_ops_for

if TYPE_CHECKING:
    from transformers import PretrainedConfig


LAYER_TYPES = ("full_attention", "sliding_attention")


def _of_layer_type(params: dict, layer_type: str) -> dict:
    if any(isinstance(params.get(t), dict) for t in LAYER_TYPES):
        return dict(params.get(layer_type) or {})
    return dict(params)


def rope_parameters(config: PretrainedConfig, layer_type: str = "full_attention") -> dict:
    """Normalise transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`).
    Gemma 3 gives each layer type its own: 5.x nests them under the type; 4.x has sliding layers
    on `rope_local_base_freq`, unscaled."""
    params = _of_layer_type(getattr(config, "rope_parameters", None) or {}, layer_type)
    scaling = _of_layer_type(getattr(config, "rope_scaling", None) or {}, layer_type)
    local_base = getattr(config, "rope_local_base_freq", None)
    if layer_type == "sliding_attention" and local_base is not None and "rope_theta" not in params:
        params, scaling = {"rope_type": "default", "rope_theta": local_base}, {}
    for k, v in scaling.items():
        params.setdefault(k, v)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    factor = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None)
    params["partial_rotary_factor"] = factor or 1.0
    return params


ROPE_TYPES = ("default", "linear", "llama3")


def rotary_dim_of(head_dim: int, params: dict) -> int:
    """The rotated width of each head (transformers: int(head_dim * partial_rotary_factor))."""
    return int(head_dim * float(params.get("partial_rotary_factor", 1.0)))


def _inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported ({', '.join(ROPE_TYPES)} are)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim_of(head_dim, params)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"partial_rotary_factor gives a rotary width of {self.rotary_dim} for head_dim {head_dim}")
        inv = _inv_freq(self.rotary_dim, params)
        pos = torch.arange(max_position, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def rotate_in_place(self, positions: torch.Tensor, qkv: torch.Tensor, heads: int) -> bool:
        """Rotate the first `heads` heads of each [T, W] row (q then k of a fused qkv) in one pass
        through the CPU op; False (nothing done) where it does not apply."""
        if self.rotary_dim != self.head_dim:  # the op rotates whole heads
            return False
        ops = cpu_ops_for(qkv)
        return ops is not None and ops.rotary(qkv, positions, self.cos, self.sin, heads, self.head_dim)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; positions: [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        if self.rotary_dim != self.head_dim:
            d = self.rotary_dim
            q = torch.cat([q[..., :d] * cos + self._rotate_half(q[..., :d]) * sin, q[..., d:]], dim=-1)
            k = torch.cat([k[..., :d] * cos + self._rotate_half(k[..., :d]) * sin, k[..., d:]], dim=-1)
            return q, k
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        return q, k
