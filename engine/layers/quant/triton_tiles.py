"""Tile shapes for the Triton weight-only GEMMs (triton_weight_gemm.py), per kernel and row
count: a table tuned on a GPU by `python -m bench.tune_triton_weight_gemm` (tuned/<device>.json,
as vLLM ships tuned Triton configs per device), else defaults that follow the usual shapes:
small tiles and inputs split across programs for few rows, tensor-core tiles for many."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import astuple, dataclass
from pathlib import Path

import torch

TUNED_DIR = Path(__file__).with_name("tuned")


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split: bool = True  # split the inputs across programs while the grid is smaller than 2 per SM


# (up to this many rows, tile); the last entry takes any count
DEFAULTS: dict[str, list[tuple[int, Tile]]] = {
    "int4": [(16, Tile(16, 64, 128)), (32, Tile(32, 64, 128)), (64, Tile(64, 64, 128)), (1 << 30, Tile(64, 128, 64))],
    "int8": [(16, Tile(16, 64, 128)), (32, Tile(32, 64, 128)), (64, Tile(64, 64, 128)), (1 << 30, Tile(64, 128, 64))],
}


def device_file(name: str) -> Path:
    return TUNED_DIR / (re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") + ".json")


@functools.cache
def _table(kind: str, device_name: str) -> list[tuple[int, Tile]]:
    path = device_file(device_name)
    if not path.is_file():
        return DEFAULTS[kind]
    rows = json.loads(path.read_text()).get(kind)
    if not rows:
        return DEFAULTS[kind]
    table = sorted((int(m), Tile(*t)) for m, t in rows.items())
    return table[:-1] + [(1 << 30, table[-1][1])]


@functools.cache
def device_info(device: torch.device) -> tuple[str, int]:
    """(name, multiprocessors): asked per linear call, read once per device (CPU: the
    interpreter's stand-in)."""
    if device.type != "cuda":
        return "cpu", 4
    props = torch.cuda.get_device_properties(device)
    return props.name, props.multi_processor_count


def tile_for(kind: str, m: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Tile:
    """Tuned tiles for 16-bit activations (what the tuner measures); float32 ones take the
    defaults (a tile tuned for bf16 can need twice the shared memory there)."""
    name = device_info(device)[0] if dtype.itemsize == 2 else "default"
    return next(t for rows, t in _table(kind, name) if m <= rows)


def splits_for(tile: Tile, m: int, n: int, steps: int, sms: int) -> tuple[int, int]:
    """(programs along the inputs, steps each): until about two programs per multiprocessor,
    at least two steps each."""
    tiles = -(-n // tile.block_n) * -(-m // tile.block_m)
    splits = max(1, min(-(-2 * sms // tiles), steps // 2)) if tile.split else 1
    per = -(-steps // splits)
    return -(-steps // per), per


def save_table(device_name: str, tables: dict[str, dict[int, Tile]]) -> Path:
    path = device_file(device_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {kind: {str(m): list(astuple(t)) for m, t in sorted(rows.items())} for kind, rows in tables.items()}
    path.write_text(json.dumps({"device": device_name, **body}, indent=1) + "\n")
    return path
