"""The Llama decoder's layers (engine/model/llama.py assembles them): attention with the
architecture's biases, per-head q/k norms and score scale; the dense or mixture-of-experts MLP;
the pre-norm decoder layer with its fused residual add. Gemma's layer (engine/model/gemma.py)
reuses the attention and MLP."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.attention.reference import ReferenceAttentionBackend
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.moe import SparseMoE, is_moe_layer
from engine.layers.norm import GemmaRMSNorm, RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.model.architectures import Architecture

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(
        self, config: PretrainedConfig, arch: Architecture, rotary: RotaryEmbedding, dtype: torch.dtype
    ) -> None:
        super().__init__()
        attn_bias = bool(getattr(config, "attention_bias", False))
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=attn_bias if arch.qkv_bias is None else arch.qkv_bias,
            dtype=dtype,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=attn_bias if arch.o_bias is None else arch.o_bias,
            dtype=dtype,
        )
        if arch.qk_norm:
            norm = GemmaRMSNorm if arch.gemma else RMSNorm
            self.q_norm = norm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = norm(self.head_dim, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary
        # Gemma scales scores by query_pre_attn_scalar ** -0.5, which need not be head_dim's.
        scalar = getattr(config, "query_pre_attn_scalar", None) if arch.gemma else None
        scale = (scalar or self.head_dim) ** -0.5
        # Gemma 2 soft-caps the scores before the softmax: only the reference backend's explicit
        # scores have that step (the C++ and Triton kernels do not), for every layer alike.
        softcap = getattr(config, "attn_logit_softcapping", None) if arch.gemma else None
        backend = ReferenceAttentionBackend(softcap) if softcap else None
        self.attn = Attention(self.qkv_proj.num_heads, self.head_dim, self.qkv_proj.num_kv_heads, scale, backend)

    @property
    def llama_math(self) -> bool:
        """Whether q and k are exactly Llama's (no norms, whole heads rotated): the fused decode
        step (fused_decode.py) computes only that."""
        return self.q_norm is None and self.rotary.rotary_dim == self.head_dim

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        t = x.shape[0]
        # The norms come before RoPE, so the rotation in place over the fused rows waits for them.
        rotated = self.q_norm is None and self.rotary.rotate_in_place(
            positions, qkv, self.qkv_proj.num_heads + self.qkv_proj.num_kv_heads
        )
        q, k, v = self.qkv_proj.split(qkv)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q, k = q.view(t, -1, self.head_dim), k.view(t, -1, self.head_dim)
        if not rotated:
            q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, intermediate_size: int | None = None) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, dtype=dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def feed_forward(config: PretrainedConfig, layer_index: int, dtype: torch.dtype) -> nn.Module:
    """A layer's MLP: dense, or mixture-of-experts (layers/moe.py) with Qwen2-MoE's shared expert."""
    if not is_moe_layer(config, layer_index):
        return LlamaMLP(config, dtype)
    shared = getattr(config, "shared_expert_intermediate_size", None)
    return SparseMoE(config, dtype, LlamaMLP(config, dtype, shared) if shared else None)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: PretrainedConfig, arch: Architecture, rotary: RotaryEmbedding, dtype: torch.dtype, index: int
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, arch, rotary, dtype)
        self.mlp = feed_forward(config, index, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual
