"""CPU backend: cache writes and decode rows through the C++ ops, prefill chunks as the reference."""
from __future__ import annotations

import torch

from engine.kernels.cpu_ops import load_cpu_ops
from engine.layers.attention.metadata import AttentionMetadata
from engine.layers.attention.reference import ReferenceAttentionBackend


def kernel_available() -> bool:
    return load_cpu_ops() is not None


class CpuPagedAttentionBackend(ReferenceAttentionBackend):
    name = "cpu_paged"
    uses_decode_buckets = False

    def __init__(self):
        self.kernel = load_cpu_ops()

    def write_kv(self, kv_cache, k, v, slot_mapping) -> None:
        if kv_cache.device.type == "cpu" and k.dtype == kv_cache.dtype:
            self.kernel.write_kv(kv_cache, k, v, slot_mapping)  # row copies, not index_copy_
        else:
            super().write_kv(kv_cache, k, v, slot_mapping)

    def decode(self, q, kv_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        nd = meta.num_decode_tokens
        if nd == 0:
            return
        if q.device.type != "cpu":
            return super().decode(q, kv_cache, meta, scale, out)
        out[:nd] = self.kernel.paged_decode(q[:nd].to(kv_cache.dtype), kv_cache[0], kv_cache[1],
                                            meta.decode_block_table, meta.decode_seq_lens, scale).to(out.dtype)
