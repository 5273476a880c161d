"""Tensor-parallel-ready linear layers (tp=1 by default).

Column-parallel: each rank owns a slice of the output features, no communication.
Row-parallel: each rank owns a slice of the input features; partial sums are all-reduced,
and the bias is added on rank 0 only so it is counted once.
Each parameter carries a `weight_loader` that slices the full checkpoint tensor for its rank.
A layer may carry LoRA slots (`lora`, engine/lora/layer.py): their delta is added to the output,
before the all-reduce of a row-parallel layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.distributed import get_tp_group, tp_all_reduce
from engine.layers.packed_gemm import linear, pack_weight
from engine.layers.quant import quantize_param
from engine.layers.weight_utils import copy_into, copy_rows_into, narrow

if TYPE_CHECKING:
    from engine.layers.quant import QuantSpec
    from engine.layers.weight_utils import Weight
    from engine.lora.layer import LoRASlots


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) is not divisible by tensor_parallel_size ({b})")
    return a // b


class ColumnParallelLinear(nn.Module):
    lora: LoRASlots | None = None  # set by engine/lora/model_lora.py

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_size, self.tp_rank = tp.size, tp.rank
        self.input_size = input_size
        self.output_size_per_partition = _divide(output_size, tp.size, "output features")
        self.weight = nn.Parameter(
            torch.empty(self.output_size_per_partition, input_size, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, w: Weight, shard_id: int | str | None = None) -> None:
        size = param.shape[0]
        copy_into(param, narrow(w, 0, self.tp_rank * size, size))

    def shard_rows(self, shard_id: int | str | None = None) -> tuple[int, int]:
        """(first row, rows) of a fused piece in this rank's output (None: all of it)."""
        return 0, self.output_size_per_partition

    def pack_weights(self) -> None:
        """After loading: the weight in oneDNN's layout (CPU; see packed_gemm)."""
        self.weight = pack_weight(self.weight)

    def quantize_weights(self, spec: QuantSpec) -> None:
        """After loading, instead of packing: this rank's shard quantized (quant/)."""
        self.weight = quantize_param(self.weight, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora.add_delta(x, y)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (e.g. gate and up projections)."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, dtype)

    def weight_loader(self, param: nn.Parameter, w: Weight, shard_id: int | None = None) -> None:
        if shard_id is None:
            return super().weight_loader(param, w)
        offset, size = self.shard_rows(shard_id)
        copy_rows_into(param, offset, narrow(w, 0, self.tp_rank * size, size))

    def shard_rows(self, shard_id: int | None = None) -> tuple[int, int]:
        if shard_id is None:
            return super().shard_rows()
        return sum(self.output_sizes[:shard_id]) // self.tp_size, self.output_sizes[shard_id] // self.tp_size


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection sharded per head. With fewer KV heads than ranks, each KV head
    is replicated on tp/num_kv_heads ranks (tp must be a multiple of num_kv_heads)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        tp = get_tp_group()
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = _divide(num_heads, tp.size, "attention heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = _divide(num_kv_heads, tp.size, "KV heads")
            self.kv_replicas = 1
        else:
            self.kv_replicas = _divide(tp.size, num_kv_heads, "tensor_parallel_size over KV heads")
            self.num_kv_heads = 1
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        super().__init__(hidden_size, out, bias, dtype)

    def weight_loader(self, param: nn.Parameter, w: Weight, shard_id: str | None = None) -> None:
        if shard_id is None:
            return super().weight_loader(param, w)
        offset, size = self.shard_rows(shard_id)
        # This rank's heads: q's own, and the KV heads it shares with tp/num_kv_heads ranks.
        start = self.tp_rank * size if shard_id == "q" else (self.tp_rank // self.kv_replicas) * size
        copy_rows_into(param, offset, narrow(w, 0, start, size))

    def shard_rows(self, shard_id: str | None = None) -> tuple[int, int]:
        if shard_id is None:
            return super().shard_rows()
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return qkv.split([q_size, kv_size, kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    lora: LoRASlots | None = None  # set by engine/lora/model_lora.py

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_size, self.tp_rank = tp.size, tp.rank
        self.output_size = output_size
        self.input_size_per_partition = _divide(input_size, tp.size, "input features")
        self.weight = nn.Parameter(
            torch.empty(output_size, self.input_size_per_partition, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = lambda p, w, shard_id=None: copy_into(p, w)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, w: Weight, shard_id: int | str | None = None) -> None:
        size = param.shape[1]
        copy_into(param, narrow(w, 1, self.tp_rank * size, size))

    def pack_weights(self) -> None:
        self.weight = pack_weight(self.weight)

    def quantize_weights(self, spec: QuantSpec) -> None:
        self.weight = quantize_param(self.weight, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        y = linear(x, self.weight, bias)
        if self.lora is not None:
            self.lora.add_delta(x, y)  # this rank's partial delta, summed by the all-reduce
        return tp_all_reduce(y)
