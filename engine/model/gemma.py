"""Gemma 3 text (`Gemma3ForCausalLM`) and Gemma 2 (`Gemma2ForCausalLM`) on the Llama decoder's
attention and linears (model/llama_layers.py). What differs (transformers' modeling_gemma3.py;
Gemma 2 has no q/k norms, one RoPE for both layer types, and soft-caps the attention scores
before the softmax, on the reference backend, and the logits: model/llama.py):

- RMSNorm scales by (1 + weight) in float32 (layers/norm.py GemmaRMSNorm), also over each q and
  k head before RoPE;
- embeddings times sqrt(hidden_size), that factor rounded to the embedding dtype first;
- four norms per layer: the attention and MLP outputs are normalised again before each residual
  add, so there is no fused add-and-norm;
- GeGLU MLP (tanh-approximated GELU);
- attention scale query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5;
- `layer_types`: sliding layers rotate with their own RoPE base (`rope_local_base_freq`), full
  ones with `rope_theta` and `rope_scaling`. No backend has a sliding window: build_model_config
  caps max_model_len at it, where windowed and full attention agree.

The fused decode step (fused_decode.py) computes Llama's layer only and declines these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.distributed import get_pp_group
from engine.layers.activation import GeluTanhAndMul
from engine.layers.norm import GemmaRMSNorm
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.layers.vocab_embedding import VocabParallelEmbedding
from engine.model.architectures import Architecture
from engine.model.llama_layers import LlamaAttention, LlamaMLP, head_dim_of
from engine.model.pipeline_stage import MissingLayer

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class GemmaMLP(LlamaMLP):
    def __init__(self, config: PretrainedConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.act = GeluTanhAndMul()


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, config: PretrainedConfig, arch: Architecture, rotary: RotaryEmbedding, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, arch, rotary, dtype)
        self.mlp = GemmaMLP(config, dtype)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, arch: Architecture, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.pp = pp = get_pp_group()
        if pp.is_first or (pp.is_last and bool(getattr(config, "tie_word_embeddings", False))):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        # A float32 scalar cast to the embedding dtype, as transformers multiplies (bf16: 55.5 for 55.43).
        scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", scale, persistent=False)
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        head_dim = head_dim_of(config)
        rotary = {
            t: RotaryEmbedding(head_dim, max_position, rope_parameters(config, t), dtype, config, t)
            for t in sorted(set(types))
        }
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, arch, rotary[t], dtype) if pp.holds_layer(i) else MissingLayer()
            for i, t in enumerate(types)
        )
        if pp.is_last:
            self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale if intermediate is None else intermediate
        for layer in self.layers:
            if not isinstance(layer, MissingLayer):
                x = layer(positions, x)
        return self.norm(x) if self.pp.is_last else x
