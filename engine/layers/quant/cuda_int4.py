"""Group-wise int4 weights on CUDA: PyTorch's tinygemm kernel (`aten._weight_int4pack_mm`, bf16
activations, sm_80+), the GPU counterpart of the CPU kernel in int4.py with the same values per
group, `(q - 8) * s + z`, and the same "two nibbles" form of 8-bit GGUF blocks.

The kernel's layout is opaque (`_convert_weight_to_int4pack` tiles it for the tensor cores), so
a quantized token embedding (a GGUF's own blocks) keeps its nibbles in plain row order too
(`.rows`, half a byte per weight, with `.scale_min` as int4_format.py keeps it) for the lookup;
linears keep only the pack.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.quant.int4_format import dequantize_groups

PAD_ROWS = 8  # the pack takes output rows in multiples of 8


def inner_k_tiles(k: int) -> int:
    for t in (8, 4, 2):
        if k % (16 * t) == 0:
            return t
    raise ValueError(f"an int4 weight on CUDA needs inputs in multiples of 32, got {k}")


def pack_int4_cuda(
    q: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    group_size: int,
    split: bool = False,
    keep_rows: bool = False,
) -> nn.Parameter:
    """q: [N, K'] 0..15 on the GPU; scale, minimum: [N, K'/g]. Returns the packed int32
    parameter with `.scales_zeros_bf16` ([K'/g, N, 2], what the kernel takes), `.group_size`,
    `.two_nibbles`, `.out_features` and, with keep_rows, `.rows` + `.scale_min` (lookups)."""
    n, k = q.shape
    pad = -n % PAD_ROWS
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scale, minimum = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scale, minimum))
    q = q.to(torch.uint8)
    pairs = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()  # even inputs in the high nibble
    param = nn.Parameter(torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles(k)), requires_grad=False)
    scale, minimum = scale.float(), minimum.float()
    sz = torch.stack([scale.t(), (minimum + 8 * scale).t()], dim=-1)  # the kernel's (q - 8) * s + z
    param.scales_zeros_bf16 = sz.to(torch.bfloat16).contiguous()
    param.group_size, param.two_nibbles, param.out_features = group_size, split, n
    param.rows, param.scale_min = (
        (pairs[:n], torch.stack([scale[:n].t(), minimum[:n].t()]).contiguous()) if keep_rows else (None, None)
    )
    return param


def int4_linear_cuda(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, dequantized weight, bias)` for a weight from `pack_int4_cuda`, in x's dtype."""
    xb = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    if weight.two_nibbles:
        xb = torch.cat([xb, xb], dim=-1)
    y = torch.ops.aten._weight_int4pack_mm(xb.contiguous(), weight, weight.group_size, weight.scales_zeros_bf16)
    y = (y if y.shape[1] == weight.out_features else y[:, : weight.out_features]).to(x.dtype)
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def embedding_int4_cuda(weight: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a packed embedding, from its plain nibbles (`.rows`)."""
    if weight.rows is None:
        raise RuntimeError("this int4 weight was packed without its rows (pack_int4_cuda keep_rows)")
    flat = ids.reshape(-1)
    pairs = weight.rows[flat]  # [T, K'/2]
    q = torch.stack([pairs >> 4, pairs & 15], dim=-1).reshape(len(flat), -1)
    w = dequantize_groups(q, weight.scale_min[:, :, flat], weight.group_size, weight.two_nibbles, dtype)
    return w.reshape(*ids.shape, w.shape[-1])
