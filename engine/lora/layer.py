"""One linear's LoRA slots and the delta it adds: y += (x @ A_s^T) @ B_s^T for the rows of slot s.

The slots are preallocated stacked tensors, so loading an adapter is a copy and a step never
allocates them: A [max_loras, pieces x max_lora_rank, in] and, per piece, B^T [max_loras,
max_lora_rank, the piece's output columns] (B stored transposed: both matmuls then read a slot's
leading rows, contiguous). A fused linear (q/k/v, gate/up) holds its pieces' A rows in blocks of
max_lora_rank, so one matmul gives every piece's low-rank activations, and each piece's B only
over its own output columns (no zeros for the other pieces': at one row per adapter a step
reads every adapter's weights once, so stored bytes are step time). A slot uses only its
adapter's ranks, not max_lora_rank.

Four forms, chosen per step by the rows and adapters in it (engine/lora/batch.py, with the
measurements): per row in one C++ call per linear that reads each row's A and B in place (Punica's
BGMV: engine/kernels/cpu/lora_bgmv.cpp, where the CPU ops are built; up to 64 rows per adapter);
per adapter, one matmul for A and one per piece for B over the adapter's rows (a slice, or
gathered by index and added back); gathered, each row's A and B copied out by its slot into one
bmm per piece over every row (decode sizes, two adapters or more); grouped (Punica's SGMV, in
PyTorch), torch's grouped_mm over the rows sorted by slot, one call for A and one per piece for
B (many rows over GROUPED_MIN_ADAPTERS adapters or more). A dense pass over every slot with a
per-row mask (two matmuls per linear whatever the adapters) was 1.3-4.3x slower than grouped at
8-64 rows over 4-16 slots (rank 16 x 3 pieces).

Tensor parallel, following the base layer's split: a column-parallel linear keeps A whole and
this rank's output columns of B (its own weight loader cuts them, so fused q/k/v keeps its heads);
a row-parallel linear keeps this rank's input columns of A (its loader again) and B whole, and the
partial delta is added before the layer's all-reduce sums it with the other ranks'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu_ops import cpu_ops_for
from engine.lora.batch import LoRABatch, get_lora_batch


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
        self.max_rank = max_rank
        # Each piece's (first column, columns) in this rank's output.
        self.outs = [(0, base.output_size)] if self.row_parallel else [base.shard_rows(s) for s in shard_ids]
        self.firsts = [first for first, _ in self.outs]
        self.A = torch.zeros(max_loras, len(shard_ids) * max_rank, in_local, dtype=dtype, device=device)
        self.Bt = [torch.zeros(max_loras, max_rank, n, dtype=dtype, device=device) for _, n in self.outs]
        self.ranks = [[0] * len(shard_ids) for _ in range(max_loras)]  # each piece's rank in slot s (0: none)

    def set_slot(self, slot: int, pieces: dict[int | str | None, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """`pieces`: shard id -> (A [r, in], B [out, r]) of the whole (unsharded) module, B scaled."""
        self.clear_slot(slot)
        for p, shard in enumerate(self.shard_ids):
            if shard not in pieces:
                continue
            a, b = pieces[shard]
            r = a.shape[0]
            a_view, bt_view = self.A[slot, p * self.max_rank : p * self.max_rank + r], self.Bt[p][slot, :r]
            if self.row_parallel:
                self.base.weight_loader(a_view, a)  # this rank's input columns
                bt_view.copy_(b.t())
            else:
                a_view.copy_(a)
                # This rank's output rows of the piece, as its loader places them in the weight.
                rows = torch.zeros(self.base.output_size_per_partition, r, dtype=b.dtype, device=b.device)
                self.base.weight_loader(rows, b, shard)
                first, n = self.outs[p]
                bt_view.copy_(rows[first : first + n].t())
            self.ranks[slot][p] = r

    def clear_slot(self, slot: int) -> None:
        """Zeroed, not only marked unused: the grouped form multiplies every slot's ranks up to
        the largest in the step, and zero rows past a slot's rank add exactly 0."""
        self.ranks[slot] = [0] * len(self.shard_ids)
        self.A[slot].zero_()
        for bt in self.Bt:
            bt[slot].zero_()

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the delta of each row's adapter (in place; rows of the base model unchanged)."""
        batch = get_lora_batch()
        if batch is None:
            return
        if batch.order is None and batch.rows is None:
            self._add_per_adapter(x, y, batch)
            return
        R = self.max_rank
        widths = [max(self.ranks[slot][p] for slot in batch.slots) for p in range(len(self.outs))]
        if not any(widths):
            return
        last = max(p * R + w for p, w in enumerate(widths) if w)
        if batch.rows is not None:
            # Each row's own A and B: in one C++ call (lora_bgmv.cpp) reading them in place, else
            # gathered by slot into one bmm for A and one per piece for B.
            ops = cpu_ops_for(x)
            if ops is not None and ops.lora_bgmv(
                x, batch.rows, batch.row_slots, self.A, last, self.Bt, self.firsts, widths, R, y
            ):
                return
            t = torch.bmm(
                x.index_select(0, batch.rows).unsqueeze(1),
                self.A[:, :last].index_select(0, batch.row_slots).transpose(1, 2),
            )
            for p, (first, n) in enumerate(self.outs):
                if widths[p]:
                    bt = self.Bt[p][:, : widths[p]].index_select(0, batch.row_slots)
                    d = torch.bmm(t[:, :, p * R : p * R + widths[p]], bt).squeeze(1)
                    y[:, first : first + n].index_add_(0, batch.rows, d)
            return
        # Rows sorted by slot: one grouped matmul over every slot's A (empty runs included), then
        # one per piece over its own B^T.
        t = F.grouped_mm(x.index_select(0, batch.order), self.A[:, :last].transpose(1, 2), offs=batch.offs)
        for p, (first, n) in enumerate(self.outs):
            if widths[p]:
                d = F.grouped_mm(
                    t[:, p * R : p * R + widths[p]].contiguous(), self.Bt[p][:, : widths[p]], offs=batch.offs
                )
                y[:, first : first + n].index_add_(0, batch.order, d)

    def _add_per_adapter(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        """One matmul for A and one per piece for B, for each adapter over its rows."""
        R = self.max_rank
        for slot, rows in batch.groups:
            ranks = self.ranks[slot]
            if not any(ranks):
                continue
            last = max(p * R + r for p, r in enumerate(ranks) if r)
            xr = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
            t = xr @ self.A[slot, :last].t()
            for p, (first, n) in enumerate(self.outs):
                r = ranks[p]
                if not r:
                    continue
                d = t[:, p * R : p * R + r] @ self.Bt[p][slot, :r]
                if isinstance(rows, slice):
                    y[rows, first : first + n] += d
                else:
                    y[:, first : first + n].index_add_(0, rows, d)
