"""Group-wise int4 weights on PyTorch's own CPU int4 kernel (`aten._weight_int4pack_mm_for_cpu`).

A weight row is cut into groups of `group_size` inputs; each group has a float scale and min and
its values are `q * scale + min`, q in 0..15 (llama.cpp's Q4_1; Q4_0 is min = -8 * scale). The
kernel reads the packed nibbles (half a byte per weight) and computes `(q - 8) * s + z` per
group, so z = min + 8 * scale (scale and z in bfloat16, as are the activations it takes).

A "two_nibbles" weight carries 8-bit values as two nibbles (Q8_0: q = 16 * hi + lo), side by side
along the input dimension, so one int4 call over [x, x] computes it exactly: the hi half has
scale 16 * d and min -128 * d, the lo half scale d and min 0.
"""

from __future__ import annotations

import torch
from torch import nn

PACK_ROWS = 64  # the CPU pack interleaves blocks of 64 output rows (see unpack_nibbles)


def pack_int4(
    q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int, split: bool = False
) -> nn.Parameter:
    """q: [N, K'] integers 0..15; scale, minimum: float [N, K' / group_size]. Returns the
    kernel's parameter: packed uint8 [N, K' / 2] with `.scales_zeros` ([K'/g, N, 2] float32),
    `.group_size` and `.two_nibbles` (K' = 2 * in_features: the two nibbles of 8-bit values)."""
    n, k = q.shape
    if k % group_size:
        raise ValueError(f"int4 weight [{n}, {k}]: inputs must divide by the group size {group_size}")
    pad = -n % PACK_ROWS  # the pack works on blocks of 64 rows: zero rows (scale 0) fill the last
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scale, minimum = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scale, minimum))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    param = nn.Parameter(packed, requires_grad=False)
    scale, minimum = scale.float(), minimum.float()
    param.scales_zeros = torch.stack([scale.t(), (minimum + 8 * scale).t()], dim=-1).contiguous()
    param.scales_zeros_bf16 = param.scales_zeros.to(torch.bfloat16)  # what the kernel takes
    param.group_size, param.two_nibbles, param.out_features = group_size, split, n
    return param


def quantize_int4(w: torch.Tensor, group_size: int) -> nn.Parameter:
    """[out, in] float weight -> packed int4, scale and min per group (round to nearest)."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return pack_int4(q, scale, lo, group_size)


def group_size_for(in_features: int, wanted: int) -> int:
    """The wanted group size, or the largest smaller one that divides the input features
    (SmolLM2's 576 inputs take no group of 128: those layers use 64)."""
    for g in (wanted, 128, 64, 32):
        if g <= wanted and in_features % g == 0:
            return g
    raise ValueError(f"no int4 group size divides {in_features} input features")


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Packed [N, K/2] -> q [N, K] uint8. Layout (checked against the pack): per block of 64
    rows and per input k, 32 bytes; byte j holds row j (low nibble) and row j + 32 (high)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    b = packed.view(n // PACK_ROWS, k, 32)
    q = torch.cat([b & 15, b >> 4], dim=2)  # [N/64, K, 64]
    return q.transpose(1, 2).reshape(n, k)


def dequantize_packed(
    packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int, split: bool, dtype: torch.dtype
) -> torch.Tensor:
    """Packed nibbles and their [K'/g, N, 2] scales/zeros -> the float weight [N, in_features]."""
    q = unpack_nibbles(packed).float()
    n, k = q.shape
    s, z = scales_zeros[..., 0].t(), scales_zeros[..., 1].t()  # [N, K'/g]
    w = ((q.view(n, k // group_size, group_size) - 8) * s[..., None] + z[..., None]).view(n, k)
    if split:
        w = w[:, : k // 2] + w[:, k // 2 :]
    return w.to(dtype)


def dequantize_int4(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    w = dequantize_packed(weight.data, weight.scales_zeros, weight.group_size, weight.two_nibbles, dtype)
    return w[: weight.out_features]


def embedding_int4(weight: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a packed weight (a quantized tied embedding): unpacks only the 64-row packs
    those ids fall in."""
    flat = ids.reshape(-1)
    packs, inside = flat // PACK_ROWS, flat % PACK_ROWS
    uniq, where = torch.unique(packs, return_inverse=True)
    n, half = weight.shape
    sub = weight.data.view(n // PACK_ROWS, -1)[uniq].view(-1, half)
    rows = (uniq[:, None] * PACK_ROWS + torch.arange(PACK_ROWS)).reshape(-1)
    w = dequantize_packed(sub, weight.scales_zeros[:, rows], weight.group_size, weight.two_nibbles, dtype)
    return w[where * PACK_ROWS + inside].reshape(*ids.shape, w.shape[-1])


def int4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, dequantized weight, bias)` for a packed int4 weight, in x's dtype. The kernel
    runs with bfloat16 activations at every row count: with float32 ones it takes a ~30x slower
    path at one row; with bf16, on a 3072x576 weight, it is 1.3 ms at 64 rows (float32 GEMM 1.8,
    dequantize + float32 GEMM 14.7) and 46.6 ms at 2048 (43.5 and 49.9)."""
    xb = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    if weight.two_nibbles:
        xb = torch.cat([xb, xb], dim=-1)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, weight, weight.group_size, weight.scales_zeros_bf16)
    y = (y if y.shape[1] == weight.out_features else y[:, : weight.out_features]).to(x.dtype)
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], y.shape[-1])
