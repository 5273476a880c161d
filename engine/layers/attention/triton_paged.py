"""CUDA backend: decode rows and prompt chunks through the Triton paged kernel, which reads
K/V from the cache by block table (the reference copies every sequence's whole context with
index_select in every layer of every step). Cache writes stay the reference's index_copy_; an
int8 or fp8 cache's rows are quantized and written by one Triton kernel (triton_kv_write.py)
and read as they are."""

from __future__ import annotations

import torch

from engine.layers.attention.kv_quant import is_quantized_cache
from engine.layers.attention.metadata import AttentionMetadata
from engine.layers.attention.reference import ReferenceAttentionBackend

# Rows per program: a decode token is G rows (one tile); prompt chunks take bigger tiles.
_DECODE_BLOCK_M = 16
_PREFILL_BLOCK_M = 64


def kernel_available(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _query(q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    return q if is_quantized_cache(kv_cache.dtype) else q.to(kv_cache.dtype)


class TritonPagedAttentionBackend(ReferenceAttentionBackend):
    name = "triton_paged"
    uses_decode_buckets = False

    def __init__(self) -> None:
        from engine.layers.attention.triton_kernel import paged_attention

        self.kernel = paged_attention

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if is_quantized_cache(kv_cache.dtype) and k.stride(-1) == 1 and v.stride(-1) == 1:
            from engine.layers.attention.triton_kv_write import write_quantized_kv

            write_quantized_kv(kv_cache, k, v, slot_mapping)
        else:
            super().write_kv(kv_cache, k, v, slot_mapping)

    def decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor
    ) -> None:
        nd = meta.num_decode_tokens
        if nd == 0:
            return
        if meta.decode_info is None:  # once per step, shared by every layer
            lens = meta.decode_seq_lens
            meta.decode_info = torch.stack(
                [torch.arange(nd, device=lens.device, dtype=torch.int32), torch.ones_like(lens), lens - 1], dim=1
            )
        self.kernel(
            _query(q, kv_cache),
            kv_cache[0],
            kv_cache[1],
            out,
            meta.decode_block_table,
            meta.decode_info,
            1,
            scale,
            _DECODE_BLOCK_M,
        )

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
        self.kernel(
            _query(q, kv_cache),
            kv_cache[0],
            kv_cache[1],
            out,
            meta.prefill_block_table,
            meta.prefill_info,
            meta.prefill_max_new,
            scale,
            _PREFILL_BLOCK_M,
        )
