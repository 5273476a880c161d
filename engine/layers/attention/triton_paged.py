"""CUDA backend: decode rows and prompt chunks through the Triton paged kernel, which reads
K/V from the cache by block table (the reference copies every sequence's whole context with
index_select in every layer of every step). Cache writes stay the reference's index_copy_."""

from __future__ import annotations

import torch

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


class TritonPagedAttentionBackend(ReferenceAttentionBackend):
    name = "triton_paged"
    uses_decode_buckets = False

    def __init__(self) -> None:
        from engine.layers.attention.triton_kernel import paged_attention

        self.kernel = paged_attention

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
            q.to(kv_cache.dtype),
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
            q.to(kv_cache.dtype),
            kv_cache[0],
            kv_cache[1],
            out,
            meta.prefill_block_table,
            meta.prefill_info,
            meta.prefill_max_new,
            scale,
            _PREFILL_BLOCK_M,
        )
