"""Pure-PyTorch paged attention: slot writes, block-table gather + SDPA. CPU and GPU.

Cache layout per layer: [2, Hkv, num_blocks, block_size, D]. Gathering whole blocks along
dim 2 yields K as [Hkv, b, L, D] contiguous, which SDPA and matmul use without another copy.
An int8 or fp8 cache has rows of D + 2 (values, then a float16 scale: kv_quant.py); rows are
quantized as they are written and dequantized as they are gathered.
GQA without copying K/V: the G query heads that share one KV head are laid out as G query
rows against that head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.attention.backend import AttentionBackend
from engine.layers.attention.kv_quant import byte_view, dequantize_rows, is_quantized_cache, quantize_rows, round_trip
from engine.layers.attention.metadata import AttentionMetadata


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _, hkv, nb, bs, w = kv_cache.shape
    dt = kv_cache.dtype
    rows = (lambda x: quantize_rows(x, dt).view(torch.uint8)) if is_quantized_cache(dt) else (lambda x: x.to(dt))
    cache = byte_view(kv_cache)
    cache[0].view(hkv, nb * bs, w).index_copy_(1, slot_mapping, rows(k.transpose(0, 1)))
    cache[1].view(hkv, nb * bs, w).index_copy_(1, slot_mapping, rows(v.transpose(0, 1)))


def gather_blocks(cache: torch.Tensor, flat_block_ids: torch.Tensor, b: int, dtype: torch.dtype) -> torch.Tensor:
    """[Hkv, num_blocks, bs, D] -> [Hkv, b, L, D] in `dtype`, contiguous (a quantized cache's
    rows dequantized)."""
    hkv, nb, bs, w = cache.shape
    out = byte_view(cache).view(hkv, nb, bs * w).index_select(1, flat_block_ids).view(hkv, b, -1, w)
    return dequantize_rows(out.view(cache.dtype), dtype) if is_quantized_cache(cache.dtype) else out.to(dtype)


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(scores / cap) in place (Gemma 2's logit soft-capping); None leaves them."""
    if cap is not None:
        scores.div_(cap).tanh_().mul_(cap)
    return scores


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """q [Hkv, b, G, D], k/v [Hkv, b, L, D], mask [b, 1, L] bool -> [Hkv, b, G, D] (also a
    prompt chunk's [Hkv, 1, G*n, D] against its mask [1, G*n, L]).

    Two small matmuls with a float32 softmax: for a handful of query rows per sequence this
    beats the CPU flash kernel, which is built for long query blocks."""
    s = soft_cap(torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale), softcap)
    s.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)


class ReferenceAttentionBackend(AttentionBackend):
    """`softcap`: scores soft-capped before the softmax (Gemma 2), with explicit scores in
    place of SDPA, which has no such step."""

    name = "reference"
    softcap: float | None = None  # also what the backends built on this one (cpu_paged) read

    def __init__(self, softcap: float | None = None) -> None:
        self.softcap = softcap

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self.write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        self.decode(q, kv_cache, meta, scale, out)
        self.prefill(q, k, v, kv_cache, meta, scale, out)
        return out

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv(kv_cache, k, v, slot_mapping)

    def decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor
    ) -> None:
        t, hq, d = q.shape
        hkv = kv_cache.shape[1]
        g = hq // hkv
        for bk in meta.decode_buckets:
            b = bk.end - bk.start
            qb = q[bk.start : bk.end].view(b, hkv, g, d).transpose(0, 1)
            kb = gather_blocks(kv_cache[0], bk.flat_block_ids, b, q.dtype)
            vb = gather_blocks(kv_cache[1], bk.flat_block_ids, b, q.dtype)
            o = decode_attention(qb, kb, vb, bk.mask, scale, self.softcap)  # [Hkv, b, G, D]
            out[bk.start : bk.end] = o.transpose(0, 1).reshape(b, hq, d)

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
        t, hq, d = q.shape
        hkv = kv_cache.shape[1]
        g = hq // hkv
        if meta.prefills and is_quantized_cache(kv_cache.dtype):
            k, v = round_trip(k, kv_cache.dtype), round_trip(v, kv_cache.dtype)
        for pc in meta.prefills:
            n = pc.num_new
            rows = slice(pc.start, pc.start + n)
            if pc.mask is None and self.softcap is None:  # no cached context: causal attention over the chunk
                o = F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1).unsqueeze(0),
                    k[rows].transpose(0, 1).unsqueeze(0),
                    v[rows].transpose(0, 1).unsqueeze(0),
                    is_causal=True,
                    scale=scale,
                    enable_gqa=True,
                )
                out[rows] = o[0].transpose(0, 1)
                continue
            # [n, Hq, D] -> [Hkv, G*n, D]: head h = kv*G + g, query rows grouped per g.
            qp = q[rows].view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
            if pc.mask is None:  # soft-capped, no cached context: the chunk's own K/V
                kp, vp, causal = k[rows].transpose(0, 1), v[rows].transpose(0, 1), _causal(n, q.device)
            else:
                total = pc.num_context + n
                kp = gather_blocks(kv_cache[0], pc.block_ids, 1, q.dtype)[:, 0, :total]
                vp = gather_blocks(kv_cache[1], pc.block_ids, 1, q.dtype)[:, 0, :total]
                causal = pc.mask
            mask = causal.repeat(g, 1)  # same causal pattern for each of the G heads
            if self.softcap is not None:
                o = decode_attention(qp[:, None], kp[:, None], vp[:, None], mask[None], scale, self.softcap)[:, 0]
            else:
                o = F.scaled_dot_product_attention(
                    qp.unsqueeze(0), kp.unsqueeze(0), vp.unsqueeze(0), attn_mask=mask, scale=scale
                )[0]
            out[rows] = o.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)


def _causal(n: int, device: torch.device) -> torch.Tensor:
    """[n, n] bool: each row sees the positions up to its own."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_()
