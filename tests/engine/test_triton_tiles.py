"""Tile tables of the Triton weight-only GEMMs (triton_tiles.py): the defaults and a tuned
table saved by the tuner are looked up by row count (the smallest bucket that holds it, the
last for any more), and the input split covers the GPU only while the grid is small."""

from __future__ import annotations

import torch

from engine.layers.quant import triton_tiles
from engine.layers.quant.triton_tiles import DEFAULTS, Tile, save_table, splits_for, tile_for


def test_defaults_by_row_count():
    cpu = torch.device("cpu")
    assert tile_for("int4", 1, cpu) == DEFAULTS["int4"][0][1]
    assert tile_for("int4", 17, cpu).block_m == 32 and tile_for("int4", 5000, cpu).block_m == 64


def test_a_saved_table_is_read_back_by_bucket(tmp_path, monkeypatch):
    monkeypatch.setattr(triton_tiles, "TUNED_DIR", tmp_path)
    triton_tiles._table.cache_clear()
    tiles = {1: Tile(16, 32, 256, 4, 2), 64: Tile(64, 128, 64), 512: Tile(128, 128, 64, 8, 3, False)}
    path = save_table("Some GPU 80GB", {"int4": tiles})
    assert path.name == "Some_GPU_80GB.json"
    table = triton_tiles._table("int4", "Some GPU 80GB")
    pick = lambda m: next(t for rows, t in table if m <= rows)  # noqa: E731
    assert pick(1) == tiles[1] and pick(2) == tiles[64] and pick(64) == tiles[64]
    assert pick(100) == tiles[512] and pick(10**6) == tiles[512]
    assert triton_tiles._table("int8", "Some GPU 80GB") == DEFAULTS["int8"]  # not tuned: defaults
    triton_tiles._table.cache_clear()


def test_inputs_split_only_while_the_grid_is_small():
    t = Tile(16, 64, 128)
    assert splits_for(t, 1, 2048, 16, 132) == (8, 2)  # 32 tiles: 8 programs per tile, 2 steps each
    assert splits_for(t, 1, 2048, 9, 132) == (3, 3)  # 9 steps: 3 x 3, no empty program
    assert splits_for(t, 1, 49152, 16, 132) == (1, 16)  # 768 tiles cover the GPU
    assert splits_for(Tile(16, 64, 128, split=False), 1, 2048, 16, 132) == (1, 16)
