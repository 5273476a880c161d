"""Rotary position embedding (neox / HF "rotate_half" layout) with default, linear, llama3,
YaRN and LongRoPE frequency scaling, cached as cos/sin tables indexed by absolute position.
Partial rotary (Phi-3's `partial_rotary_factor` < 1) rotates the first `rotary_dim` of each
head and passes the rest through.

YaRN and LongRoPE frequencies and their attention factor come from transformers' own
`ROPE_INIT_FUNCTIONS`. LongRoPE (Phi-3 128k, Phi-3.5) has two sets: transformers uses the long
one for a whole forward once the sequence passes `original_max_position_embeddings`, which
would make a prefix's keys depend on what follows it. Here a position takes the short factors
below that length and the long ones from it on, so cached blocks stay valid and results do not
depend on the batch; within that length (4,096 for Phi-3's 128k models) both agree exactly."""

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


TRANSFORMERS_ROPE_TYPES = ("yarn", "longrope")  # computed by transformers' ROPE_INIT_FUNCTIONS
ROPE_TYPES = ("default", "linear", "llama3", *TRANSFORMERS_ROPE_TYPES)


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


def _transformers_freqs(
    config: PretrainedConfig | None, params: dict, pos: torch.Tensor, layer_type: str | None
) -> tuple[torch.Tensor, float]:
    """(position x frequency angles, attention factor) for YaRN and LongRoPE, from transformers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = params["rope_type"]
    if config is None:
        raise ValueError(f"rope_scaling type {kind!r} needs the model's config")
    nested = any(isinstance((getattr(config, "rope_parameters", None) or {}).get(t), dict) for t in LAYER_TYPES)
    kw = {"layer_type": layer_type} if nested else {}
    init = ROPE_INIT_FUNCTIONS[kind]
    inv, attention_factor = init(config, torch.device("cpu"), **kw)
    freqs = pos[:, None] * inv.float()[None, :]
    if kind == "longrope":
        original = int(params.get("original_max_position_embeddings") or config.original_max_position_embeddings)
        long_inv, _ = init(config, torch.device("cpu"), seq_len=original + 1, **kw)
        far = pos >= original
        freqs[far] = pos[far, None] * long_inv.float()[None, :]
    return freqs, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: dict,
        dtype: torch.dtype = torch.float32,
        config: PretrainedConfig | None = None,
        layer_type: str | None = None,
    ) -> None:
        """`config` (and `layer_type` where the config nests its RoPE per layer type): what
        transformers computes YaRN and LongRoPE from."""
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim_of(head_dim, params)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"partial_rotary_factor gives a rotary width of {self.rotary_dim} for head_dim {head_dim}")
        pos = torch.arange(max_position, dtype=torch.float32)
        if params["rope_type"] in TRANSFORMERS_ROPE_TYPES:
            freqs, scale = _transformers_freqs(config, params, pos, layer_type)
        else:
            freqs, scale = pos[:, None] * _inv_freq(self.rotary_dim, params)[None, :], 1.0
        emb = torch.cat([freqs, freqs], dim=-1)
        # transformers scales cos and sin by the attention factor (YaRN, LongRoPE), in float32
        self.register_buffer("cos", (emb.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(dtype), persistent=False)

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
