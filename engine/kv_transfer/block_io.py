"""The runner half of the KV hand-off: copy whole blocks out of and into one rank's paged cache
(and token slots between its blocks, for tail hits).

A rank's cache is one tensor per layer, (2, local kv heads, blocks, block_size, head_dim); a
rank holds heads [rank * local, (rank + 1) * local) of the model's (column-parallel QKV).
"""

from __future__ import annotations

import torch

from engine.layers.attention.kv_quant import byte_view


def read_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """(layers, 2, local heads, len(block_ids), block_size, head_dim), a copy on the CPU."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    # Through uint8 views: PyTorch has no CPU index_select/index_copy_ for float8.
    out = torch.stack([byte_view(c).index_select(2, idx) for c in kv_caches]).cpu()
    return out.view(kv_caches[0].dtype)


def write_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], data: torch.Tensor) -> None:
    """Write `data` (this rank's heads, as `read_blocks` returns them) into `block_ids`."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    data = byte_view(data.to(kv_caches[0].device))
    for cache, layer in zip(kv_caches, data.unbind(0)):
        byte_view(cache).index_copy_(2, idx, layer)


def copy_slots(kv_caches: list[torch.Tensor], copies: list[tuple[int, int, int]]) -> None:
    """Tail hits' copy-on-write (engine/core/tail_hits.py): for each (src, dst, n), the first
    n token slots of block src into block dst, in every layer. The scheduler holds every src
    until the step has run, so no copy's dst is another's src."""
    for cache in kv_caches:
        c = byte_view(cache)
        for src, dst, n in copies:
            c[:, :, dst, :n].copy_(c[:, :, src, :n])


def head_slice(data: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """One rank's KV heads of a full-heads payload (dim 2)."""
    local = data.shape[2] // world_size
    return data[:, :, rank * local : (rank + 1) * local]
