"""Triton paged attention: query rows read K/V straight from the paged cache through the
block table (no gathered copy of the context), online softmax in float32.

One program computes one tile of a sequence's new tokens against one KV head. The G query
heads sharing that KV head become G rows per token, so GQA costs no K/V copies and a decode
row still fills a tensor-core tile (BLOCK_M >= 16). The same kernel serves decode rows
(one new token each) and prompt chunks (many; causal over cached + new positions).

A quantized cache (int8 or fp8 rows, kv_quant.py) is read as it is: the values widen to q's
dtype (exactly: |int8| <= 127 and every e4m3 value fit bf16), each key row's scale multiplies
its column of scores and each value row's scale its column of probabilities, so no
dequantized copy of a row is made.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.attention.kv_quant import is_quantized_cache


@triton.jit
def _paged_attention(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    table_ptr,
    info_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kh,
    stride_kb,
    stride_ks,
    stride_vh,
    stride_vb,
    stride_vs,
    stride_table,
    stride_info,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    QUANT: tl.constexpr,
):
    seq, tile, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row0 = tl.load(info_ptr + seq * stride_info)  # first row of this sequence in q
    n_new = tl.load(info_ptr + seq * stride_info + 1)
    n_ctx = tl.load(info_ptr + seq * stride_info + 2)  # tokens cached before this step
    BLOCK_Q: tl.constexpr = BLOCK_M // G
    q_start = tile * BLOCK_Q
    if q_start >= n_new:  # grid sized for the longest chunk
        return
    offs_m = tl.arange(0, BLOCK_M)
    tok = q_start + offs_m // G
    head = h * G + offs_m % G
    row_ok = (offs_m < BLOCK_Q * G) & (tok < n_new)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    rows = (row0 + tok).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q_pos = n_ctx + tok  # absolute position: sees keys 0..q_pos
    kv_end = n_ctx + tl.minimum(q_start + BLOCK_Q, n_new)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_ptr + h.to(tl.int64) * stride_kh
    v_base = v_ptr + h.to(tl.int64) * stride_vh
    for start in range(0, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        blk = tl.load(table_ptr + seq * stride_table + offs_n // BS, mask=n_ok, other=0).to(tl.int64)
        k_row = k_base + blk * stride_kb + (offs_n % BS) * stride_ks
        k = tl.load(k_row[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if QUANT:  # the row's float16 scale sits after its D values
            k_scale = tl.load((k_row + D).to(tl.pointer_type(tl.float16)), mask=n_ok, other=0.0).to(tl.float32)
            k = k.to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if QUANT:
            s = s * k_scale[None, :]
        s = tl.where(n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None]), s * scale, float("-inf"))
        # Key 0 is visible to every row in the first tile, so m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_row = v_base + blk * stride_vb + (offs_n % BS) * stride_vs
        v = tl.load(v_row[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if QUANT:
            v_scale = tl.load((v_row + D).to(tl.pointer_type(tl.float16)), mask=n_ok, other=0.0).to(tl.float32)
            p = p * v_scale[None, :]
            v = v.to(q.dtype)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(
        o_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_table: torch.Tensor,
    info: torch.Tensor,
    max_new: int,
    scale: float,
    block_m: int,
    block_n: int = 64,
) -> None:
    """out[rows] = attention of q's rows for each sequence in `info` ([S, 3] int32: first row,
    new tokens, cached tokens) over its blocks in `block_table` ([S, max_blocks] int32).
    q/out [T, Hq, D]; k_cache/v_cache [Hkv, num_blocks, block_size, D] (last dim contiguous), or
    D + 2 for a quantized cache (int8/float8_e4m3fn rows with their scales; q stays float)."""
    hq, d = q.shape[1], q.shape[2]
    quant = is_quantized_cache(k_cache.dtype)
    if not quant and q.dtype != k_cache.dtype:
        raise ValueError(f"q is {q.dtype}, the cache {k_cache.dtype}")
    hkv, bs = k_cache.shape[0], k_cache.shape[2]
    g = hq // hkv
    block_m = max(block_m, triton.next_power_of_2(g), 16)
    block_q = block_m // g
    grid = (info.shape[0], triton.cdiv(max_new, block_q), hkv)
    _paged_attention[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_table,
        info,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        info.stride(0),
        G=g,
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
        BS=bs,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
        QUANT=quant,
        num_warps=4,
        num_stages=2,
    )
