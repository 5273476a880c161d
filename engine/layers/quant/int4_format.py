"""Group-wise int4 weights as stored: PyTorch's CPU int4 pack (`_convert_weight_to_int4pack_for_cpu`)
with exact scales and mins beside it. The compute paths that read them are in int4.py.

A weight row is cut into groups of `group_size` inputs; each group has a float scale and min and
its values are `q * scale + min`, q in 0..15 (llama.cpp's Q4_1; Q4_0 is min = -8 * scale).
PyTorch's kernel reads the packed nibbles (half a byte per weight) and computes `(q - 8) * s + z`
per group, so z = min + 8 * scale (`.scales_zeros_bf16`, in bfloat16 as are the activations it
takes).

A "two_nibbles" weight carries 8-bit values as two nibbles (Q8_0: q = 16 * hi + lo), side by side
along the input dimension, so one int4 call over [x, x] computes it exactly: the hi half has
scale 16 * d and min -128 * d, the lo half scale d and min 0.

A 5-bit weight (GGUF's Q5_0, Q5_1, Q5_K: q in 0..31) is its low nibbles in that pack plus
`.hi_bits`, a plane of the high bits laid out like the pack ([N / rows, K, rows / 8]: per block of
rows and per input, bit r of the rows / 8 bytes is row r's): 5 bits a weight where two nibbles
take 8. Only the C++ ops read it (int4.py: where they run every row count).

`.scale_min` holds the exact scales and mins (float16 where that holds them exactly, as it does
GGUF's) for dequantizing and exact mode, blocked by 64 rows ([N / 64, K'/g, 2, 64]): the C++ op
streams a block's bytes and then its scales lie beside each other instead of one group's per
page (block_scales; scale_planes undoes it).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

PACK_ROWS = 64  # N is padded to a multiple of the CPU pack's row blocks (64, or 32: see pack_layout)
SCALE_ROWS = 64  # rows per block of `.scale_min` (the C++ ops' kScaleRows)


def pack_int4(
    q: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    group_size: int,
    split: bool = False,
    hi_bits: torch.Tensor | None = None,
) -> nn.Parameter:
    """q: [N, K'] integers 0..15; scale, minimum: float [N, K' / group_size]; hi_bits: [N, K'] 0 or 1
    (a 5-bit weight: its values are q + 16 * hi_bits), or None. Returns the
    kernel's parameter: packed uint8 [N, K' / 2] with `.scale_min` (the groups' scales and mins,
    block_scales of [2, K'/g, N]), `.scales_zeros_bf16` (PyTorch's kernel's), `.group_size`, `.two_nibbles`
    (K' = 2 * in_features: the two nibbles of 8-bit values) and `.hi_bits` (pack_hi_bits, or None)."""
    n, k = q.shape
    if k % group_size:
        raise ValueError(f"int4 weight [{n}, {k}]: inputs must divide by the group size {group_size}")
    pad = -n % PACK_ROWS  # the pack works on blocks of 64 rows: zero rows (scale 0) fill the last
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        hi_bits = None if hi_bits is None else torch.cat([hi_bits, hi_bits.new_zeros(pad, k)])
        scale, minimum = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scale, minimum))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    param = nn.Parameter(packed, requires_grad=False)
    scale, minimum = scale.float(), minimum.float()
    param.scale_min = half_if_exact(block_scales(torch.stack([scale.t(), minimum.t()])))
    zeros = torch.stack([scale.t(), (minimum + 8 * scale).t()], dim=-1)  # the kernel's (q - 8) * s + z
    param.scales_zeros_bf16 = zeros.to(torch.bfloat16).contiguous()
    param.group_size, param.two_nibbles, param.out_features = group_size, split, n
    param.input_order = None  # GPTQ act-order sets the column order (quant/apply.py)
    param.hi_bits = None if hi_bits is None else pack_hi_bits(hi_bits)
    return param


def pack_hi_bits(bits: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """[N, K] 0/1 (N a multiple of `rows`, by default the pack's) -> uint8 [N / rows, K, rows / 8]:
    per block of rows and per input, bit r (byte r // 8, bit r % 8) is row r's."""
    rows = rows or pack_layout()[1]
    n, k = bits.shape
    b = bits.to(torch.int32).view(n // rows, rows // 8, 8, k).permute(0, 3, 1, 2)  # [blocks, k, byte, bit]
    return (b << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8).contiguous()


def unpack_hi_bits(packed_bits: torch.Tensor) -> torch.Tensor:
    """pack_hi_bits' inverse: [N, K] uint8 0/1."""
    blocks, k, nbytes = packed_bits.shape
    b = (packed_bits[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [blocks, k, byte, bit]
    return b.permute(0, 2, 3, 1).reshape(blocks * nbytes * 8, k)


def weight_values(weight: torch.Tensor) -> torch.Tensor:
    """A packed weight's integers [N, K'] (0..15, or 0..31 with its high bits)."""
    q = unpack_nibbles(weight.data)
    hi = getattr(weight, "hi_bits", None)
    return q if hi is None else q + 16 * unpack_hi_bits(hi)


def block_scales(planes: torch.Tensor) -> torch.Tensor:
    """[2, G, N] scale and min planes (N a multiple of SCALE_ROWS) -> [N / 64, G, 2, 64]: per
    block of 64 rows, per group, its 64 scales then its 64 mins."""
    two, g, n = planes.shape
    return planes.reshape(two, g, n // SCALE_ROWS, SCALE_ROWS).permute(2, 1, 0, 3).contiguous()


def block_pairs(pairs: torch.Tensor) -> torch.Tensor:
    """PyTorch's kernel's [G, N, 2] (scale, zero) pairs (N a multiple of SCALE_ROWS) -> the same
    values blocked by 64 rows, [N / 64, G, 64, 2]: per block of rows, each group's pairs together
    (what the few-row op reads best: int4_scales.h pairs_at)."""
    g, n, two = pairs.shape
    return pairs.view(g, n // SCALE_ROWS, SCALE_ROWS, two).permute(1, 0, 2, 3).contiguous()


def scale_planes(scale_min: torch.Tensor) -> torch.Tensor:
    """A weight's blocked `.scale_min` -> the [2, G, N] scale and min planes."""
    blocks, g, two, rows = scale_min.shape
    return scale_min.permute(2, 1, 0, 3).reshape(two, g, blocks * rows)


def row_scales(scale_min: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The [2, G, len(rows)] scales and mins of some rows of a blocked `.scale_min`."""
    return scale_min[rows // SCALE_ROWS, :, :, rows % SCALE_ROWS].permute(2, 1, 0)


def quantize_groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (q 0..15, scale, min) per group of inputs (round to nearest)."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return q, scale, lo


def half_if_exact(t: torch.Tensor) -> torch.Tensor:
    """float16 where every value survives the round trip (GGUF's scales and mins are float16, and
    Q8_0's 16 * d and -128 * d stay exact): the op reads half the bytes; else float32."""
    h = t.half()
    return h if torch.equal(h.float(), t) else t


def quantize_int4(w: torch.Tensor, group_size: int) -> nn.Parameter:
    """[out, in] float weight -> packed int4, scale and min per group (round to nearest)."""
    return pack_int4(*quantize_groups(w, group_size), group_size)


def group_size_for(in_features: int, wanted: int) -> int:
    """The wanted group size, or the largest smaller one that divides the input features
    (SmolLM2's 576 inputs take no group of 128: those layers use 64)."""
    for g in (wanted, 128, 64, 32):
        if g <= wanted and in_features % g == 0:
            return g
    raise ValueError(f"no int4 group size divides {in_features} input features")


def _unpack(packed: torch.Tensor, layout: tuple[str, int]) -> torch.Tensor:
    kind, rows = layout
    n, k = packed.shape[0], packed.shape[1] * 2
    b = packed.view(n // rows, k, rows // 2)
    pair = (b & 15, b >> 4)
    q = torch.cat(pair, dim=2) if kind == "halves" else torch.stack(pair, dim=3).view(n // rows, k, rows)
    return q.transpose(1, 2).reshape(n, k)


@functools.cache
def pack_layout() -> tuple[str, int]:
    """How `_convert_weight_to_int4pack_for_cpu` lays nibbles out here, which depends on the vector
    code PyTorch runs: per block of `rows` output rows and per input k, rows / 2 bytes; byte j holds
    row j (low nibble) and row j + rows / 2 (high) for "halves" (64 rows on AVX-512, 32 on AVX2),
    rows 2j and 2j + 1 for "pairs" (its scalar code). Found by packing a probe."""
    q = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    for layout in (("halves", 64), ("halves", 32), ("pairs", 64)):
        if torch.equal(_unpack(packed, layout).int(), q):
            return layout
    raise NotImplementedError("unknown layout of PyTorch's CPU int4 pack")


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Packed [N, K/2] -> q [N, K] uint8 (see pack_layout)."""
    return _unpack(packed, pack_layout())


def dequantize_groups(
    q: torch.Tensor, scale_min: torch.Tensor, group_size: int, split: bool, dtype: torch.dtype
) -> torch.Tensor:
    """q [N, K'] 0..15 (0..31: 5-bit) and their [2, K'/g, N] scales and mins -> the float weight [N, in_features]
    (the two halves of a two-nibble weight summed)."""
    q = q.float()
    n, k = q.shape
    s, mn = scale_min[0].t().float(), scale_min[1].t().float()  # [N, K'/g]
    w = (q.view(n, k // group_size, group_size) * s[..., None] + mn[..., None]).view(n, k)
    if split:
        w = w[:, : k // 2] + w[:, k // 2 :]
    return w.to(dtype)


def dequantize_int4(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    planes = scale_planes(weight.scale_min)
    w = dequantize_groups(weight_values(weight), planes, weight.group_size, weight.two_nibbles, dtype)
    return w[: weight.out_features]


def embedding_int4(weight: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a packed weight (a quantized tied embedding): gathers only those rows' bytes
    (unpacking each id's whole 64-row pack took ~7% of a 32-row decode step)."""
    flat = ids.reshape(-1)
    kind, block = pack_layout()
    n, half = weight.shape
    packs = weight.data.view(n // block, 2 * half, block // 2)  # [pack, k, byte]
    inside = flat % block
    if kind == "halves":  # byte j: row j (low nibble) and row j + block / 2 (high)
        col, high = inside % (block // 2), inside >= block // 2
    else:  # byte j: rows 2j (low) and 2j + 1 (high)
        col, high = inside // 2, inside % 2 == 1
    b = packs[(flat // block)[:, None], torch.arange(2 * half)[None, :], col[:, None]]  # [T, k]
    q = torch.where(high[:, None], b >> 4, b & 15)
    if getattr(weight, "hi_bits", None) is not None:  # [blocks, k, block / 8]: row r at byte r // 8, bit r % 8
        hb = weight.hi_bits[(flat // block)[:, None], torch.arange(2 * half)[None, :], (inside // 8)[:, None]]
        q = q + 16 * ((hb >> (inside % 8).to(torch.uint8)[:, None]) & 1)
    w = dequantize_groups(q, row_scales(weight.scale_min, flat), weight.group_size, weight.two_nibbles, dtype)
    return w.reshape(*ids.shape, w.shape[-1])
