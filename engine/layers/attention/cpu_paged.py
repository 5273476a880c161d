"""CPU backend: cache writes, decode rows and prompt chunks through the C++ ops (PyTorch's
reference path wherever an op does not apply). An int8 cache (kv_quant.py) is quantized by the
write op and read as it is by the decode and prompt ops, with q and out in the model's dtype."""

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

    def __init__(self) -> None:
        self.kernel = load_cpu_ops()

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if kv_cache.device.type == "cpu" and kv_cache.dtype == torch.int8:
            self.kernel.write_kv_int8(kv_cache, k, v, slot_mapping)
        elif kv_cache.device.type == "cpu" and k.dtype == kv_cache.dtype:
            self.kernel.write_kv(kv_cache, k, v, slot_mapping)  # row copies, not index_copy_
        else:
            super().write_kv(kv_cache, k, v, slot_mapping)

    def decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor
    ) -> None:
        nd = meta.num_decode_tokens
        if nd == 0:
            return
        if q.device.type != "cpu":  # get_backend refuses this; the step built no decode buckets to fall back on
            raise RuntimeError(f"cpu_paged attention got {q.device} tensors; it runs on CPU only")
        qd = q[:nd] if kv_cache.dtype == torch.int8 else q[:nd].to(kv_cache.dtype)
        out[:nd] = self.kernel.paged_decode(
            qd, kv_cache[0], kv_cache[1], meta.decode_block_table, meta.decode_seq_lens, scale
        ).to(out.dtype)

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        if not meta.prefills:
            return
        if q.device.type == "cpu" and meta.prefill_info is not None:
            qc = (q if kv_cache.dtype == torch.int8 else q.to(kv_cache.dtype)).contiguous()
            direct = out.is_contiguous() and out.dtype == qc.dtype
            o = out if direct else torch.empty_like(qc)
            if self.kernel.prefill_attention(
                qc, kv_cache[0], kv_cache[1], meta.prefill_block_table, meta.prefill_info, scale, o
            ):
                if not direct:
                    rows = slice(meta.num_decode_tokens, None)
                    out[rows] = o[rows].to(out.dtype)
                return
        super().prefill(q, k, v, kv_cache, meta, scale, out)
