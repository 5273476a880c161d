"""Vocab-parallel embedding and LM head.

Each rank owns a contiguous slice of the (padded) vocabulary. Embedding: rows outside the
slice are masked to zero, then all-reduced. LM head: each rank computes its slice of the
logits and rank 0 gathers them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import get_tp_group, tp_all_reduce, tp_gather_last_dim
from engine.layers.packed_gemm import linear, pack_weight
from engine.layers.quant import QuantSpec, is_quantized, quantize_param
from engine.layers.quant.apply import has_blocks
from engine.layers.quant.cuda_int4 import is_cuda_int4
from engine.layers.weight_utils import copy_rows_into, narrow, shape_of

if TYPE_CHECKING:
    from engine.layers.weight_utils import Weight


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_size, self.tp_rank = tp.size, tp.rank
        self.vocab_size, self.dtype = vocab_size, dtype
        self.per_partition = -(-vocab_size // tp.size)  # ceil: the last shard is padded
        self.start = tp.rank * self.per_partition
        self.end = min(self.start + self.per_partition, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.per_partition, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, w: Weight, shard_id: int | str | None = None) -> None:
        rows = shape_of(w)[0]
        if rows != self.vocab_size:
            raise ValueError(f"embedding has {rows} rows, config says vocab_size={self.vocab_size}")
        n = self.end - self.start
        copy_rows_into(param, 0, narrow(w, 0, self.start, n))

    def quantize_weights(self, spec: QuantSpec) -> None:
        """Only a GGUF's own blocks (e.g. a Q8_0 token embedding) stay quantized here: the lookup
        unpacks the rows it needs. A float embedding stays float."""
        if has_blocks(self.weight):
            self.weight = quantize_param(self.weight, spec, keep_rows=True)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if is_cuda_int4(self.weight):
            from engine.layers.quant.cuda_int4 import embedding_int4_cuda

            return embedding_int4_cuda(self.weight, ids, self.dtype or torch.get_default_dtype())
        if self.weight.dtype == torch.uint8:
            from engine.layers.quant.int4_format import embedding_int4

            return embedding_int4(self.weight, ids, self.dtype or torch.get_default_dtype())
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(ids)
        mask = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(mask, 0)
        out = self._lookup(local).masked_fill(mask.unsqueeze(-1), 0)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False, dtype: torch.dtype | None = None) -> None:
        super().__init__(vocab_size, hidden_size, dtype)
        self.bias = None
        self.tied = False
        self.packed_weight: torch.Tensor | None = None

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.tied = True
        self.__dict__["tied_embedding"] = embedding  # not registered: it is model.embed_tokens

    def pack_weights(self) -> None:
        """After loading (CPU, see packed_gemm). A tied weight stays plain for the embedding
        lookup and the head gets a packed copy; an untied one is replaced."""
        if self.tied:
            packed = pack_weight(self.weight)
            self.packed_weight = packed.data  # a tensor, not a second registered parameter
            self.packed_weight.plain = None if packed.plain is None else self.weight.data  # no second plain copy
            self.packed_weight.out_features = getattr(packed, "out_features", None)  # bf16 panels (pack_rows16)
        else:
            self.weight = pack_weight(self.weight)

    def quantize_weights(self, spec: QuantSpec) -> None:
        """A tied float weight stays float for the embedding lookup and the head gets a quantized
        copy; a tied GGUF-quantized embedding is the head as it is. With int4 the head is int8:
        as llama.cpp's 4-bit files keep it at 8 bits (SmolLM2, int4:g32: perplexity +5.3% with
        an int4 head). An 8-bit head is stored as two nibbles where the int4 op runs, for float32
        logits (quant/apply.int8_as_nibbles)."""
        if spec.method == "int4":
            spec = QuantSpec("int8")
        if self.tied:
            if is_quantized(self.tied_embedding.weight):
                self.weight = self.tied_embedding.weight
            elif not has_blocks(self.weight):
                q = quantize_param(self.weight, spec)
                self.packed_weight = q if q is not self.weight else None
        else:
            self.weight = quantize_param(self.weight, spec)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocab logits on rank 0 (None elsewhere); padding columns removed."""
        w = self.packed_weight if self.packed_weight is not None else self.weight
        if w.dtype == torch.uint8 and not is_cuda_int4(w):  # CPU int4 pack: float32 logits at every row count
            from engine.layers.quant.int4 import int4_logits

            logits = int4_logits(hidden, w)
        else:
            logits = linear(hidden, w)
        logits = tp_gather_last_dim(logits)
        if logits is None:
            return None
        return logits[..., : self.vocab_size]
