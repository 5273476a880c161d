"""The runner half of the offload tier: one rank copies blocks of its KV shard out to its store
and back, at the start of a step (before the step's tail copies and forward write any block).

Saves go first: a block saved and a block loaded in one step may be the same block (evicted
for the load's own target), and a hash saved in a step may be loaded in the same step. Block
contents move through the KV hand-off's own copier (engine/kv_transfer/block_io.py).
"""

from __future__ import annotations

import logging
import time

import torch

from engine.kv_offload.store import OffloadStore
from engine.kv_transfer.block_io import read_blocks, write_blocks

log = logging.getLogger(__name__)


def save_blocks(kv_caches: list[torch.Tensor], store: OffloadStore, saves: list[tuple[int, int, int]]) -> None:
    """(block id, slot, hash): this rank's shard of each block into its slot, one contiguous
    write per block. A failed write leaves its slot unreadable (loaded as a miss)."""
    t0 = time.perf_counter()
    data = read_blocks(kv_caches, [b for b, _, _ in saves])  # (layers, 2, heads, n, block, width)
    for i, (_, slot, block_hash) in enumerate(saves):
        try:
            store.write(slot, block_hash, data[:, :, :, i])
        except (OSError, ValueError, RuntimeError) as e:
            log.warning("offload tier: saving a block failed (%s); it will be recomputed", e)
    store.seconds_saving += time.perf_counter() - t0


def load_blocks(kv_caches: list[torch.Tensor], store: OffloadStore, loads: list[tuple[int, int, int]]) -> list[bool]:
    """(slot, block id, hash): each slot's bytes into its block when the slot holds that hash
    intact. Returns which loads failed on this rank (those blocks are left as they were)."""
    t0 = time.perf_counter()
    failed = [True] * len(loads)
    try:
        if store.usable():
            c = kv_caches[0]
            # (n, layers, 2, heads, block, width): one contiguous read per block.
            staging = torch.empty((len(loads), len(kv_caches), *c.shape[:2], *c.shape[3:]), dtype=c.dtype)
            for i, (slot, _, block_hash) in enumerate(loads):
                failed[i] = not store.read(slot, block_hash, staging[i])
            ok = [i for i, f in enumerate(failed) if not f]
            if ok:
                data = staging if len(ok) == len(loads) else staging[ok]
                write_blocks(kv_caches, [loads[i][1] for i in ok], data.permute(1, 2, 3, 0, 4, 5))
    except (OSError, ValueError, RuntimeError) as e:
        log.warning("offload tier: loading blocks failed (%s); they will be recomputed", e)
        failed = [True] * len(loads)
    store.seconds_loading += time.perf_counter() - t0
    return failed
