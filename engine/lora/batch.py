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


@dataclass
class LoRABatch:
    # (slot, its rows): a slice where the slot's rows are one run (every step whose requests of
    # one adapter are adjacent), else an index tensor on the step's device.
    groups: list[tuple[int, slice | torch.Tensor]]
    # With GROUPED_MIN_ADAPTERS or more groups: the adapter rows sorted by slot, and the end of
    # each slot's run among them (int32, one per slot: grouped_mm's `offs`). Else None.
    order: torch.Tensor | None = None
    offs: torch.Tensor | None = None

    @property
    def slots(self) -> list[int]:
        return [slot for slot, _ in self.groups]

    @staticmethod
    def build(
        slots: list[int], starts: list[int], counts: list[int], device: torch.device, num_slots: int = 0
    ) -> LoRABatch | None:
        """`slots[i]`: the slot of the request whose rows are [starts[i], starts[i] + counts[i]);
        None when no row has an adapter. `num_slots`: the slots a layer holds (the grouped form
        needs it; 0: never grouped)."""
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
        if num_slots == 0 or len(runs) < GROUPED_MIN_ADAPTERS:
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
