"""A step's rows grouped by adapter slot: built once per step by the model runner, read by
every LoRA layer through a context (ARCHITECTURE.md, rule 7), like the attention metadata."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

NO_SLOT = -1  # a row of the base model


# From this many adapters in a step on, every LoRA linear computes its deltas with two grouped
# matmuls over the rows sorted by slot (torch's grouped_mm) instead of a matmul pair per adapter.
# Measured on a 2-core EPYC, float32, one thread, fused q/k/v of SmolLM2 at rank 16, 16 rows:
# 1 adapter 0.09 ms looped against 0.16 grouped, 4 adapters 0.20 against 0.20, 16 adapters 1.26
# against 0.65; for whole steps see docs/lora.md (python -m bench.bench_lora).
GROUPED_MIN_ADAPTERS = 4

# Up to this many adapter rows in a step, and no more than GATHER_ROWS_PER_ADAPTER per adapter,
# over two adapters or more: each row's A and B are gathered by its slot and one batched matmul
# (bmm) per piece does every row at once. At decode sizes that beats both other forms: the grouped
# matmuls' per-group work costs more than copying a few rows' weights. Measured on a 2-core EPYC,
# float32, 2 threads, fused q/k/v of SmolLM2 at rank 16 with each layer's slots cold (30 layers):
# 16 rows over 16 adapters 0.24 ms gathered against 0.49 grouped, 32 over 16 0.32 against 0.70,
# 16 over 4 0.19 against 0.27, 16 over 2 0.13 against 0.15 per adapter; from 64 rows on grouped
# wins (64 over 16: 0.76 against 1.61), and one adapter is fastest alone (16 rows: 0.09 against
# 0.12).
GATHER_MAX_ROWS = 32
GATHER_ROWS_PER_ADAPTER = 8

# Where the C++ CPU ops are built (engine/kernels/cpu/lora_bgmv.cpp), up to this many rows per
# adapter in the step every row's delta comes from one call per linear that reads each row's
# weights in place. Measured as above (q/k/v, float32, 2 threads, slots cold), against the form
# PyTorch's ops would take: 16 rows over 16 adapters 0.04 ms against 0.24 gathered, 64 over 16
# 0.28 against 0.94 grouped, 1,024 over 16 2.1 against 7.8, 512 over 4 0.91 against 1.20, one
# adapter over 32 rows 0.06 against 0.10 per adapter; one adapter over 256 rows 0.42 against
# 0.28 (one GEMM over many rows wins there).
BGMV_ROWS_PER_ADAPTER = 64


@dataclass
class LoRABatch:
    # (slot, its rows): a slice where the slot's rows are one run (every step whose requests of
    # one adapter are adjacent), else an index tensor on the step's device.
    groups: list[tuple[int, slice | torch.Tensor]]
    # With GROUPED_MIN_ADAPTERS or more groups: the adapter rows sorted by slot, and the end of
    # each slot's run among them (int32, one per slot: grouped_mm's `offs`). Else None.
    order: torch.Tensor | None = None
    offs: torch.Tensor | None = None
    # Per row (BGMV_ROWS_PER_ADAPTER, GATHER_MAX_ROWS): the adapter rows and each one's slot
    # (int64), for the C++ op or PyTorch's gathered form. Else None.
    rows: torch.Tensor | None = None
    row_slots: torch.Tensor | None = None

    @property
    def slots(self) -> list[int]:
        return [slot for slot, _ in self.groups]

    @staticmethod
    def build(
        slots: list[int],
        starts: list[int],
        counts: list[int],
        device: torch.device,
        num_slots: int = 0,
        bgmv: bool = False,
    ) -> LoRABatch | None:
        """`slots[i]`: the slot of the request whose rows are [starts[i], starts[i] + counts[i]);
        None when no row has an adapter. `num_slots`: the slots a layer holds (the grouped and
        per-row forms need it; 0: per adapter only). `bgmv`: the C++ per-row op is there."""
        runs: dict[int, list[tuple[int, int]]] = {}
        for slot, start, n in zip(slots, starts, counts):
            if slot == NO_SLOT or n == 0:
                continue
            r = runs.setdefault(slot, [])
            if r and r[-1][1] == start:
                r[-1] = (r[-1][0], start + n)
            else:
                r.append((start, start + n))
        if not runs:
            return None
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, r in runs.items():
            if len(r) == 1:
                groups.append((slot, slice(r[0][0], r[0][1])))
            else:
                rows = [i for a, b in r for i in range(a, b)]
                groups.append((slot, torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)))
        if num_slots == 0:
            return LoRABatch(groups)
        num_rows = sum(b - a for r in runs.values() for a, b in r)
        if (bgmv and num_rows <= BGMV_ROWS_PER_ADAPTER * len(runs)) or (
            len(runs) >= 2 and num_rows <= min(GATHER_MAX_ROWS, GATHER_ROWS_PER_ADAPTER * len(runs))
        ):
            rows = [
                i for slot, start, n in zip(slots, starts, counts) if slot != NO_SLOT for i in range(start, start + n)
            ]
            row_slots = [slot for slot, n in zip(slots, counts) if slot != NO_SLOT for _ in range(n)]
            return LoRABatch(
                groups,
                rows=torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
                row_slots=torch.tensor(row_slots, dtype=torch.int64).to(device, non_blocking=True),
            )
        if len(runs) < GROUPED_MIN_ADAPTERS:
            return LoRABatch(groups)
        order: list[int] = []
        offs: list[int] = []
        for slot in range(num_slots):
            order += [i for a, b in runs.get(slot, ()) for i in range(a, b)]
            offs.append(len(order))
        return LoRABatch(
            groups,
            torch.tensor(order, dtype=torch.int64).to(device, non_blocking=True),
            torch.tensor(offs, dtype=torch.int32).to(device, non_blocking=True),
        )


_CURRENT: LoRABatch | None = None


def get_lora_batch() -> LoRABatch | None:
    return _CURRENT


@contextlib.contextmanager
def lora_context(batch: LoRABatch | None) -> Iterator[None]:
    global _CURRENT
    prev, _CURRENT = _CURRENT, batch
    try:
        yield
    finally:
        _CURRENT = prev
