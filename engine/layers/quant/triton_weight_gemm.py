"""Weight-only quantized GEMMs on CUDA in Triton, for every row count: y = x . W^T with W read
as int4 groups or int8 rows and widened in registers (no float copy of the weight in memory).

PyTorch's kernels left quantized weights slow on a GPU: tinygemm (`_weight_int4pack_mm`) is
built for a few rows (int4 at 0.34x bf16's tokens/s at batch 256 on an H100), and PyTorch's
int8 kernel was 5-17x slower than cuBLAS, so int8 weights were widened to a float copy per call.
A program computes one output tile [BLOCK_M, BLOCK_N] over a run of BLOCK_K-input steps:

- int4 (cuda_int4.py's plain rows: [N, K'/2] bytes, even input in the high nibble, and per
  group two planes [2, K'/g, N]: scale and min, or scale and zero point `z = min + 8 s` where
  `.centered`): each step widens its nibbles to `(q - 8) * s + z` in x's dtype (centred, as
  tinygemm computes, so a rounded scale or zero moves little) and takes two dots, even and odd
  inputs. A two-nibble weight (8-bit GGUF blocks, K' = 2K) reads x at input k mod K.
- int8 (int8.py: [N, K] int8, one scale per output): y = (x . q) * s.

Tile shapes per row count come from triton_tiles.py (tuned per GPU). Few rows make few tiles,
so the inputs are split across programs too (split-K) until the grid covers the
multiprocessors; the partial sums go to a float32 buffer summed in a fixed order
(deterministic). The dot runs in x's dtype (float32: TF32) with float32 sums; tile shapes
follow the row count, so as with cuBLAS a row's last bits can depend on the rows beside it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.quant.triton_tiles import Tile, device_info, splits_for, tile_for


@triton.jit
def _int4_kernel(
    x_ptr, w_ptr, sm_ptr, y_ptr, M, N, NS, K, KX, stride_xm, stride_ys, stride_ym, STEPS, ITERS,
    GROUP: tl.constexpr, CENTERED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_K // 2)  # byte j holds inputs 2j (high nibble) and 2j + 1
    m_ok, n_ok = offs_m < M, offs_n < N
    groups = K // GROUP
    w_rows = w_ptr + offs_n[None, :].to(tl.int64) * (K // 2)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_s * ITERS
    for it in range(first, tl.minimum(first + ITERS, STEPS)):
        j = it * (BLOCK_K // 2) + offs_j
        b = tl.load(w_rows + j[:, None], mask=n_ok[None, :], other=0)  # [BK/2, BN]
        g = (j // (GROUP // 2))[:, None]
        s = tl.load(sm_ptr + g * NS + offs_n[None, :], mask=n_ok[None, :], other=0.0).to(tl.float32)
        z = tl.load(sm_ptr + (groups + g) * NS + offs_n[None, :], mask=n_ok[None, :], other=0.0).to(tl.float32)
        if not CENTERED:
            z += 8.0 * s
        kx = (2 * j) % KX
        xe = tl.load(x_rows + kx[None, :], mask=m_ok[:, None], other=0.0)  # [BM, BK/2]
        xo = tl.load(x_rows + (kx + 1)[None, :], mask=m_ok[:, None], other=0.0)
        hi = (((b >> 4).to(tl.float32) - 8.0) * s + z).to(xe.dtype)
        lo = (((b & 15).to(tl.float32) - 8.0) * s + z).to(xe.dtype)
        acc += tl.dot(xe, hi) + tl.dot(xo, lo)
    y = y_ptr + pid_s * stride_ys + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _int8_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_ys, stride_ym, STEPS, ITERS,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    w_rows = w_ptr + offs_n[None, :].to(tl.int64) * K
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_s * ITERS
    for it in range(first, tl.minimum(first + ITERS, STEPS)):
        k = it * BLOCK_K + offs_k
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        q = tl.load(w_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
        acc += tl.dot(x, q.to(x.dtype))  # -127..127: exact in every float dtype
    acc *= tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]  # splits too: linear
    y = y_ptr + pid_s * stride_ys + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(kernel, x2, n: int, steps: int, tile: Tile, bias, out_dtype, args: tuple, meta: dict) -> torch.Tensor:
    m = x2.shape[0]
    splits, per = splits_for(tile, m, n, steps, device_info(x2.device)[1])
    out = torch.empty(splits, m, n, dtype=out_dtype if splits == 1 else torch.float32, device=x2.device)
    grid = (triton.cdiv(n, tile.block_n), triton.cdiv(m, tile.block_m), splits)
    kernel[grid](
        x2, *args, out, *meta.pop("sizes"), x2.stride(0), out.stride(0), out.stride(1), steps, per,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, num_warps=tile.num_warps, num_stages=tile.num_stages, **meta,
    )  # fmt: skip
    y = out[0] if splits == 1 else out.sum(0)  # fixed order: deterministic
    if bias is not None:
        y = y + bias
    return y.to(out_dtype)


def _block_k(k: int, wanted: int) -> int:
    """The largest of wanted, wanted / 2, ... (at least 32) that divides k (k' is a multiple of 32)."""
    b = wanted
    while k % b:
        b //= 2
    return max(b, 32)


def int4_matmul(
    x: torch.Tensor, rows: torch.Tensor, planes: torch.Tensor, group: int, out_features: int,
    bias: torch.Tensor | None = None, centered: bool = False, tile: Tile | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [..., K] . W^T for W = plain int4 rows [N >= out_features, K'/2] (K' = K, or 2K for a
    two-nibble weight) with planes [2, K'/group, N]: scale and min (or zero point, `centered`);
    in x's dtype. `tile`: this shape instead of triton_tiles' (the tuner)."""
    x2 = _rows(x)
    m, kx = x2.shape
    n, k = out_features, rows.shape[1] * 2
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    tile = tile or tile_for("int4", m, x.device, x.dtype)
    bk = _block_k(k, tile.block_k)
    meta = dict(sizes=(m, n, planes.shape[-1], k, kx), GROUP=group, CENTERED=centered, BLOCK_K=bk)
    y = _launch(_int4_kernel, x2, n, k // bk, tile, bias, x.dtype, (rows, planes), meta)
    return y.reshape(*x.shape[:-1], n)


def int8_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, tile: Tile | None = None
) -> torch.Tensor:
    """x [..., K] . (q * scale[:, None])^T for an int8 weight [N, K]; in x's dtype."""
    x2 = _rows(x)
    m, k = x2.shape
    n = q.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    tile = tile or tile_for("int8", m, x.device, x.dtype)
    bk = tile.block_k  # masked: any k
    y = _launch(
        _int8_kernel, x2, n, triton.cdiv(k, bk), tile, bias, x.dtype, (q, scale), dict(sizes=(m, n, k), BLOCK_K=bk)
    )
    return y.reshape(*x.shape[:-1], n)
