"""Group-wise int4 weights on CUDA, the GPU counterpart of the CPU kernels in int4.py with the
same values per group, `q * s + min`, and the same "two nibbles" form of 8-bit GGUF blocks. Two
forms, per cuda_kernel_choice:

- "torch" (the default): PyTorch's tinygemm kernel (`aten._weight_int4pack_mm`, bf16
  activations, sm_80+), built for a few rows. Its layout is opaque
  (`_convert_weight_to_int4pack` tiles it for the tensor cores), so a quantized embedding keeps
  its nibbles in plain rows too (`.rows`) for the lookup; linears keep only the pack.
- "triton": plain rows, [N, K'/2] uint8 with the even input in the high nibble, and
  `.scale_min` [2, K'/g, N] (scales and mins in float16 where exact, as GGUF's are, else
  scales and zero points in bfloat16, `.centered`); triton_weight_gemm.py's kernel reads them
  at every row count, and a quantized token embedding looks its rows up in the same bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.quant.cuda_kernel_choice import cuda_quant_kernel
from engine.layers.quant.int4_format import dequantize_groups, half_if_exact

PAD_ROWS = 8  # the pack takes output rows in multiples of 8


def is_cuda_int4(w: torch.Tensor) -> bool:
    """A weight in one of this module's forms (on CPU, uint8 is int4.py's pack)."""
    return w.dtype == torch.int32 or (w.dtype == torch.uint8 and w.is_cuda)


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
    """q: [N, K'] 0..15 on the GPU; scale, minimum: [N, K'/g]. Returns the plain rows (uint8,
    "triton") or tinygemm's int32 pack with `.scales_zeros_bf16` ([K'/g, N, 2], what it takes)
    and, with keep_rows, `.rows` (lookups); both carry `.scale_min`, `.group_size`,
    `.two_nibbles` and `.out_features`."""
    if cuda_quant_kernel("int4") == "triton":
        q = q.to(torch.uint8)
        param = nn.Parameter((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), requires_grad=False)
        # Scales and mins in float16 where exact (GGUF's); else, as tinygemm keeps them, scales
        # and zero points z = min + 8 s in bfloat16 (`.centered`): z is small where min is not,
        # so rounding it moves the weights far less (engine logprobs vs the CPU engine's: mean
        # gap 0.03 with zero points, 0.09 with bf16 mins). float32 would add half the bytes again.
        scale, minimum = scale.float().t(), minimum.float().t()
        planes = half_if_exact(torch.stack([scale, minimum]).contiguous())
        param.centered = planes.dtype != torch.float16
        if param.centered:
            planes = torch.stack([scale, minimum + 8 * scale]).to(torch.bfloat16).contiguous()
        param.scale_min = planes
        param.group_size, param.two_nibbles, param.out_features = group_size, split, q.shape[0]
        param.input_order = None
        param.rows = param.scales_zeros_bf16 = None  # the rows are the parameter itself
        return param
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
    param.input_order = None
    param.rows, param.scale_min = (
        (pairs[:n], torch.stack([scale[:n].t(), minimum[:n].t()]).contiguous()) if keep_rows else (None, None)
    )
    return param


def int4_linear_cuda(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, dequantized weight, bias)` for a weight from `pack_int4_cuda`, in x's dtype."""
    if weight.dtype == torch.uint8:
        from engine.layers.quant.triton_weight_gemm import int4_matmul

        return int4_matmul(x, weight, weight.scale_min, weight.group_size, weight.out_features, bias, weight.centered)
    xb = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    if weight.two_nibbles:
        xb = torch.cat([xb, xb], dim=-1)
    y = torch.ops.aten._weight_int4pack_mm(xb.contiguous(), weight, weight.group_size, weight.scales_zeros_bf16)
    y = (y if y.shape[1] == weight.out_features else y[:, : weight.out_features]).to(x.dtype)
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def embedding_int4_cuda(weight: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a packed embedding, from its plain nibbles (the parameter, or `.rows`)."""
    rows = weight if weight.dtype == torch.uint8 else weight.rows
    if rows is None:
        raise RuntimeError("this int4 weight was packed without its rows (pack_int4_cuda keep_rows)")
    flat = ids.reshape(-1)
    pairs = rows[flat]  # [T, K'/2]
    q = torch.stack([pairs >> 4, pairs & 15], dim=-1).reshape(len(flat), -1)
    planes = weight.scale_min[:, :, flat].float()
    if getattr(weight, "centered", False):  # scale and zero point: min = z - 8 s
        planes = torch.stack([planes[0], planes[1] - 8 * planes[0]])
    w = dequantize_groups(q, planes, weight.group_size, weight.two_nibbles, dtype)
    return w.reshape(*ids.shape, w.shape[-1])
