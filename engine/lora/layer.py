"""One linear's LoRA slots and the delta it adds: y += (x @ A_s^T) @ B_s^T for the rows of slot s.

The slots are preallocated stacked tensors, so loading an adapter is a copy and a step never
allocates them: A [max_loras, pieces x max_lora_rank, in] and B^T [max_loras, pieces x
max_lora_rank, out] (B stored transposed: both matmuls then read a slot's leading rows, contiguous).
A fused linear (q/k/v, gate/up) holds its pieces' ranks side by side: piece p's A rows and B^T
rows are its own columns of the low-rank space, and its B^T is zero outside the piece's output
columns, so each piece's delta lands in its own output slice with one matmul pair per adapter.
A slot uses only its adapter's ranks (`width`), not max_lora_rank.

Grouped by adapter (Punica's SGMV, in PyTorch): one matmul pair per adapter in the step over its
rows (a slice, or gathered by index and added back); from GROUPED_MIN_ADAPTERS adapters in a step
on (engine/lora/batch.py), torch's grouped_mm over the rows sorted by slot does the pairs in two
calls. Measured on a 2-core EPYC, float32, one
thread, q/k/v of SmolLM2 (576 -> 1728) at rank 16: 16 rows over 1/4/16 adapters 0.15/0.33/1.8 ms
grouped against 1.9/1.7/2.2 ms for a per-row gather of A and B with bmm, and 512 rows over 4
adapters 3.6 ms against 81 ms: grouped everywhere. A dense pass over every slot with a per-row
mask (two matmuls per linear whatever the adapters) was 1.3-4.3x slower than grouped at 8-64
rows over 4-16 slots (rank 16 x 3 pieces). Per-op dispatch, not arithmetic, is what a step's
deltas cost at a few rows (one matmul pair per adapter per linear per layer).

Tensor parallel, following the base layer's split: a column-parallel linear keeps A whole and
this rank's output columns of B (its own weight loader cuts them, so fused q/k/v keeps its heads);
a row-parallel linear keeps this rank's input columns of A (its loader again) and B whole, and the
partial delta is added before the layer's all-reduce sums it with the other ranks'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.lora.batch import get_lora_batch


class LoRASlots:
    def __init__(
        self,
        base: nn.Module,
        shard_ids: list[int | str | None],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.base = base
        self.shard_ids = shard_ids  # the base loader's shard id of each piece (None: not fused)
        self.row_parallel = hasattr(base, "input_size_per_partition")
        in_local = base.input_size_per_partition if self.row_parallel else base.input_size
        out_local = base.output_size if self.row_parallel else base.output_size_per_partition
        cols = len(shard_ids) * max_rank
        self.A = torch.zeros(max_loras, cols, in_local, dtype=dtype, device=device)
        self.Bt = torch.zeros(max_loras, cols, out_local, dtype=dtype, device=device)
        self.width = [0] * max_loras  # low-rank columns slot s uses (0: no delta)

    def set_slot(self, slot: int, pieces: dict[int | str | None, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """`pieces`: shard id -> (A [r, in], B [out, r]) of the whole (unsharded) module, B scaled."""
        self.clear_slot(slot)
        off = 0
        for shard in self.shard_ids:
            if shard not in pieces:
                continue
            a, b = pieces[shard]
            r = a.shape[0]
            a_view, bt_view = self.A[slot, off : off + r], self.Bt[slot, off : off + r]
            if self.row_parallel:
                self.base.weight_loader(a_view, a)  # this rank's input columns
                bt_view.copy_(b.t())
            else:
                a_view.copy_(a)
                self.base.weight_loader(bt_view.t(), b, shard)  # this rank's output rows, as the weight's
            off += r
        self.width[slot] = off

    def clear_slot(self, slot: int) -> None:
        """Zeroed, not only marked unused: the grouped form multiplies every slot's columns up to
        the widest in the step, and a zero B^T makes those past a slot's width add exactly 0
        (fused: B^T is zero outside each piece's output columns too)."""
        self.width[slot] = 0
        self.A[slot].zero_()
        self.Bt[slot].zero_()

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the delta of each row's adapter (in place; rows of the base model unchanged)."""
        batch = get_lora_batch()
        if batch is None:
            return
        if batch.order is not None:
            w = max(self.width[slot] for slot in batch.slots)
            if w == 0:
                return
            # Rows sorted by slot, one grouped matmul pair over every slot (empty runs included).
            t = F.grouped_mm(x.index_select(0, batch.order), self.A[:, :w].transpose(1, 2), offs=batch.offs)
            y.index_add_(0, batch.order, F.grouped_mm(t, self.Bt[:, :w], offs=batch.offs))
            return
        for slot, rows in batch.groups:
            w = self.width[slot]
            if w == 0:
                continue
            a, bt = self.A[slot, :w], self.Bt[slot, :w]
            if isinstance(rows, slice):
                y[rows] += (x[rows] @ a.t()) @ bt
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ bt)
