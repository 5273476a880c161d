"""A step's rows grouped by adapter slot: built once per step by the model runner, read by
every LoRA layer through a context (ARCHITECTURE.md, rule 7), like the attention metadata."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

NO_SLOT = -1  # a row of the base model


@dataclass
class LoRABatch:
    # (slot, its rows): a slice where the slot's rows are one run (every step whose requests of
    # one adapter are adjacent), else an index tensor on the step's device.
    groups: list[tuple[int, slice | torch.Tensor]]

    @staticmethod
    def build(slots: list[int], starts: list[int], counts: list[int], device: torch.device) -> LoRABatch | None:
        """`slots[i]`: the slot of the request whose rows are [starts[i], starts[i] + counts[i]);
        None when no row has an adapter."""
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
        return LoRABatch(groups)


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
