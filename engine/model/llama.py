"""Llama-family decoder in the project's own code: Llama 2/3 (llama3 RoPE scaling), Mistral,
Qwen2 (QKV bias), Qwen3 (per-head q/k RMSNorm), Phi-3 (fused checkpoint tensors, partial
rotary), SmolLM2, the mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE (layers/moe.py), and
Gemma 3 (its model in engine/model/gemma.py); the layers are engine/model/llama_layers.py.
GQA/MQA; tied embeddings. Tensor-parallel through its layers (experts: expert-parallel). How each
architecture differs is engine/model/architectures.py; config fields the engine does not
implement are refused at construction (engine/model/config_check.py).

Parameter names follow Hugging Face checkpoints. The fused `qkv_proj` and `gate_up_proj` are
filled from the separate q/k/v and gate/up tensors, or, for a checkpoint that stores them fused
(Phi-3), from each fused tensor cut into its parts, so each rank keeps its own heads of each part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from engine.distributed import get_pp_group
from engine.layers.attention import Attention
from engine.layers.attention.reference import soft_cap
from engine.layers.moe import SparseMoE
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.weight_utils import default_weight_loader, shape_of
from engine.model.architectures import SUPPORTED_ARCHITECTURES, Architecture  # noqa: F401 - named from here
from engine.model.config_check import check_model_config
from engine.model.fused_checkpoint import RowWindow, row_window
from engine.model.fused_decode import FusedDecode
from engine.model.gemma import GemmaModel
from engine.model.llama_layers import LlamaDecoderLayer, head_dim_of
from engine.model.pipeline_stage import MissingLayer, holds_weight

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# checkpoint name fragment -> (fused parameter fragment, shard id)
_STACKED = [
    (".q_proj", ".qkv_proj", "q"),
    (".k_proj", ".qkv_proj", "k"),
    (".v_proj", ".qkv_proj", "v"),
    (".gate_proj", ".gate_up_proj", 0),
    (".up_proj", ".gate_up_proj", 1),
]


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, arch: Architecture, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.pp = pp = get_pp_group()
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if pp.is_first or (pp.is_last and tied):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        rotary = RotaryEmbedding(head_dim_of(config), max_position, rope_parameters(config), dtype, config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, arch, rotary, dtype, i) if pp.holds_layer(i) else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        if pp.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self._fused: FusedDecode | None | bool = False  # False: not built yet (weights load first)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The final hidden states; on a stage before the last, the residual stream after its
        layers (hidden + residual: the next layer's add-and-norm would add them first), which the
        next stage passes as `intermediate` and starts from as a first layer starts from the
        embedding."""
        x = self.embed_tokens(input_ids) if intermediate is None else intermediate
        if self._fused is False:
            self._fused = FusedDecode.for_model(self)
        fused = self._fused.run(x, positions) if self._fused is not None else None
        if fused is not None:
            x, residual = fused
        else:
            residual = None
            for layer in self.layers:
                if not isinstance(layer, MissingLayer):
                    x, residual = layer(positions, x, residual)
        if not self.pp.is_last:
            return x + residual
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, config: PretrainedConfig, max_position: int | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.arch = check_model_config(config)
        self.config = config
        max_position = max_position or config.max_position_embeddings
        if self.arch.gemma:
            self.model = GemmaModel(config, self.arch, max_position, dtype)
        else:
            self.model = LlamaModel(config, self.arch, max_position, dtype)
        self.pp = get_pp_group()
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.pp.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype=dtype)
            if self.tie_word_embeddings:
                self.lm_head.tie(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head.compute_logits(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None) if self.arch.gemma else None
        return soft_cap(logits, cap) if logits is not None else None

    def attention_layers(self) -> list[Attention]:
        """This stage's, in layer order."""
        return [layer.self_attn.attn for layer in self.model.layers if not isinstance(layer, MissingLayer)]

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Load (name, tensor-or-lazy-slice) pairs; returns the parameter names filled."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        moe = {
            i: layer.mlp
            for i, layer in enumerate(self.model.layers)
            if isinstance(getattr(layer, "mlp", None), SparseMoE)
        }
        for name, w in weights:
            if "rotary_emb.inv_freq" in name or not holds_weight(name, self.pp, self.tie_word_embeddings):
                continue
            if moe and name.startswith("model.layers."):
                block = moe.get(int(name.split(".")[2]))
                name = block.checkpoint_name(name) if block is not None else name
                if name is None:
                    continue  # an expert another rank holds
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # tied: the embedding is the head
            if self.arch.fused_checkpoint and (parts := self._fused_parts(name, w)) is not None:
                param = params[name]
                for shard, part in parts:
                    param.weight_loader(param, part, shard)
                loaded.add(name)
                continue
            for frag, fused, shard in _STACKED:
                if frag in name:
                    target = name.replace(frag, fused)
                    param = params[target]
                    param.weight_loader(param, w, shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint has an unexpected tensor {name!r}")
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, w)
                loaded.add(name)
        if self.tie_word_embeddings and self.pp.is_last:
            loaded.add("lm_head.weight")
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")
        return loaded

    def _fused_parts(self, name: str, w: object) -> list[tuple[str | int, RowWindow | torch.Tensor]] | None:
        """A fused checkpoint tensor (`qkv_proj`: q, k, v rows; `gate_up_proj`: gate, up rows)
        as (shard id, its rows) for the fused layer's loader, which keeps this rank's heads of
        each part; None for any other tensor. Loading the whole tensor as one would give each
        rank a contiguous band of rows: q heads only on rank 0, k and v on the last rank."""
        c = self.config
        hd = head_dim_of(c)
        if ".qkv_proj." in name:
            sizes = [
                ("q", c.num_attention_heads * hd),
                ("k", c.num_key_value_heads * hd),
                ("v", c.num_key_value_heads * hd),
            ]
        elif ".gate_up_proj." in name:
            sizes = [(0, c.intermediate_size), (1, c.intermediate_size)]
        else:
            return None
        rows = shape_of(w)[0]
        if rows != sum(n for _, n in sizes):
            raise ValueError(f"{name} has {rows} rows, the config gives {sum(n for _, n in sizes)}")
        parts, offset = [], 0
        for shard, n in sizes:
            parts.append((shard, row_window(w, offset, n)))
            offset += n
        return parts
