"""Mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's
top-k experts, and each expert that has tokens runs once over all of them (tokens grouped by
expert, one gate/up and one down GEMM per expert, as transformers' and vLLM's reference paths do).

Expert parallelism: under tensor parallelism each rank holds whole experts (expert e on rank
e % tp), computes its experts' share for every token, and the shares are summed by the same
all-reduce a row-parallel layer ends with. The router is replicated and kept in float; the
experts' linears quantize like any other (quant/apply.py). Qwen2-MoE's shared expert is an
ordinary tensor-parallel MLP, gated per token by a sigmoid.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TPGroup, bound_tp_group, get_tp_group, tp_all_reduce
from engine.layers.activation import SiluAndMul
from engine.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear
from engine.layers.weight_utils import copy_into

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Checkpoint names of an expert's linears -> the Llama MLP's (Mixtral: w1 gate, w3 up, w2 down).
_EXPERT = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(\w+)\.(weight|bias)")
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def num_experts(config: PretrainedConfig) -> int:
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)


def is_moe_layer(config: PretrainedConfig, layer_index: int) -> bool:
    """Qwen2-MoE's `mlp_only_layers` and `decoder_sparse_step` leave some layers dense."""
    if num_experts(config) == 0 or layer_index in (getattr(config, "mlp_only_layers", None) or []):
        return False
    return (layer_index + 1) % int(getattr(config, "decoder_sparse_step", 1) or 1) == 0


class Expert(nn.Module):
    """One whole expert on this rank (not sharded: its linears are built for one rank)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        with bound_tp_group(TPGroup(1, 0, None)):
            self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], dtype=dtype)
            self.down_proj = ColumnParallelLinear(inter, hidden, dtype=dtype)  # column: no all-reduce
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, shared_mlp: nn.Module | None = None) -> None:
        super().__init__()
        tp = get_tp_group()
        self.num_experts = num_experts(config)
        self.top_k = int(config.num_experts_per_tok)
        # Mixtral always renormalizes the top-k weights; Qwen's MoE models say so in the config.
        self.renormalize = bool(getattr(config, "norm_topk_prob", True))
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        self.owned = list(range(tp.rank, self.num_experts, tp.size))
        self.local = {e: i for i, e in enumerate(self.owned)}
        self.experts = nn.ModuleList(Expert(config.hidden_size, inter, dtype) for _ in self.owned)
        self.gate = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=dtype), requires_grad=False)
        self.gate.weight_loader = lambda p, w, shard_id=None: copy_into(p, w)
        self.shared_expert = shared_mlp
        if shared_mlp is not None:
            self.shared_expert_gate = nn.Parameter(torch.empty(1, config.hidden_size, dtype=dtype), requires_grad=False)
            self.shared_expert_gate.weight_loader = lambda p, w, shard_id=None: copy_into(p, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(x, self.gate).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            out = self._every_expert(x, weights, chosen)
        else:
            out = self._chosen_experts(x, weights, chosen)
        out = tp_all_reduce(out)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return out

    def _chosen_experts(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each chosen expert over its own tokens: which experts those are is read on the host."""
        out = torch.zeros_like(x)
        for expert in torch.unique(chosen).tolist():
            local = self.local.get(expert)
            if local is None:
                continue  # another rank's expert
            rows, slot = torch.where(chosen == expert)
            y = self.experts[local](x[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(x.dtype))
        return out

    def _every_expert(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Every local expert over every token, weighted by zero where not chosen: no host read,
        so a CUDA graph can capture it (decode steps of at most 256 rows). It computes
        experts/top_k times the chosen experts' work, the same sum in another order."""
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        dense.scatter_(1, chosen, weights)
        out = torch.zeros_like(x)
        for expert, local in self.local.items():
            out += (self.experts[local](x) * dense[:, expert, None]).to(x.dtype)
        return out

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's parameter name here (Mixtral's and Qwen's names alike), None for
        an expert another rank holds."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = _EXPERT.fullmatch(name)
        if m is not None:
            layer, expert, proj, kind = m.groups()
            local = self.local.get(int(expert))
            return None if local is None else f"{layer}.mlp.experts.{local}.{_MIXTRAL.get(proj, proj)}.{kind}"
        if name.endswith((".mlp.gate.weight", ".mlp.shared_expert_gate.weight")):
            return name.removesuffix(".weight")  # plain parameters, not linears
        return name
