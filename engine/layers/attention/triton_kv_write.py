"""Triton write of new K/V rows into a quantized cache (int8 or fp8 rows, kv_quant.py): one
program per (token, KV head, K or V) takes the row's absmax, rounds its float16 scale and
stores the quantized values and the scale at the token's slot. In PyTorch the same write is
~10 kernels per layer (abs, amax, divide, round, clamp, cast, cat, two index_copy_), which at
batch 1 cost more than the attention itself. The arithmetic is `quantize_rows`' own (IEEE
division, round half to even, scale rounded to float16 first), so both write the same bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.attention.kv_quant import QMAX


@triton.jit
def _write_quantized_rows(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ckv,
    stride_ch,
    stride_cslot,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QMAX: tl.constexpr,
    INT8: tl.constexpr,
):
    t, h, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    if which == 0:
        x = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs, mask=ok, other=0.0).to(tl.float32)
    else:
        x = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.minimum(tl.math.div_rn(amax, QMAX), 65504.0).to(tl.float16)
    s = scale.to(tl.float32)
    y = tl.math.div_rn(x, tl.where(s > 0, s, 1.0))
    y = tl.where(s > 0, y, 0.0)
    row = cache_ptr + which * stride_ckv + h.to(tl.int64) * stride_ch + slot * stride_cslot
    if INT8:
        r = tl.floor(y + 0.5)  # round half to even, as torch.round
        r = tl.where((r - y == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r)
        q = tl.minimum(tl.maximum(r, -QMAX), QMAX).to(tl.int8)
    else:
        q = tl.minimum(tl.maximum(y, -QMAX), QMAX).to(row.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(row + offs, q, mask=ok)
    tl.store((row + D).to(tl.pointer_type(tl.float16)), scale)


def write_quantized_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] (any float dtype) into kv_cache [2, Hkv, blocks, block_size, D + 2] at
    slot_mapping [T] (flat slot = block * block_size + offset)."""
    t, hkv, d = k.shape
    if t == 0:
        return
    _, _, nb, bs, w = kv_cache.shape
    flat = kv_cache.view(2, hkv, nb * bs, w)
    _write_quantized_rows[(t, hkv, 2)](
        k,
        v,
        flat,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        flat.stride(0),
        flat.stride(1),
        flat.stride(2),
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
        QMAX=QMAX[kv_cache.dtype],
        INT8=kv_cache.dtype == torch.int8,
        num_warps=1,
    )
