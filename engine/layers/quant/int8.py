"""Weight-only int8: symmetric, one float scale per output channel, quantized at load.

The matmul is PyTorch's own weight-only int8 kernel (`aten._weight_int8pack_mm`), which reads
the int8 weight once with bfloat16 activations: at the few rows of a decode step it streams a
quarter of float32's bytes (measured on SmolLM2's shapes, 2-core AVX2: 1536x576 at one row
59 us against 100 us float32; the 49152x576 LM head 2.6 ms against 9.2 ms). Past
INT8_MM_ROWS rows (prompt chunks) the step is compute-bound and that kernel falls behind a
float GEMM, so the weight is dequantized for the call instead (a transient copy). Where the
few-row int4 op runs (AVX-512), quantize_param stores int8 weights as two nibbles for that op
instead (apply.int8_as_nibbles: 1.8x the tokens/s of one stream here, float32 sums, the fused
decode step); this module runs them elsewhere.

On CUDA PyTorch's int8 kernel is far slower than cuBLAS at every row count (H100, ~1B Llama:
76 against 367 tok/s at batch 1, 392 against 6,570 at batch 32). There the int8 weight runs
through triton_weight_gemm.py's kernel (widened in registers, the per-channel scale applied to
the output), or with `ORBITAL_CUDA_QUANT_KERNEL=torch` is widened to a float copy for the call
(`python -m bench.bench_gpu`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.quant.cuda_kernel_choice import cuda_quant_kernel

INT8_MM_ROWS = 32  # measured crossover: 32 rows about even, 64 rows the float GEMM wins


def quantize_int8(w: torch.Tensor) -> nn.Parameter:
    """[out, in] float weight -> int8 parameter carrying `.scale` (float32 [out]) and
    `.scale_bf16` (what the kernel takes)."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    # Rounded up to a bf16 value: the CPU kernels take bf16 scales, and a rounded one would scale
    # a whole output channel off by up to 0.2% (int8 perplexity +0.45% -> +0.30%, measured).
    bits = scale.to(torch.bfloat16).view(torch.int16)
    bits = bits + (bits.view(torch.bfloat16).float() < scale).to(torch.int16)
    scale = bits.view(torch.bfloat16).float()
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    param = nn.Parameter(q, requires_grad=False)
    param.scale = scale.contiguous()
    param.scale_bf16 = scale.to(torch.bfloat16)
    return param


def int8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, dequantized weight, bias)` for a weight from `quantize_int8`, in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.is_cuda and cuda_quant_kernel("int8") == "triton":
        from engine.layers.quant.triton_weight_gemm import int8_matmul

        y = int8_matmul(x2, weight, weight.scale, bias)
    elif x2.is_cuda:
        y = F.linear(x2, weight.to(x.dtype)) * weight.scale.to(x.dtype)
        if bias is not None:
            y += bias
    elif x2.shape[0] <= INT8_MM_ROWS:
        y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), weight, weight.scale_bf16).to(x.dtype)
        if bias is not None:
            y += bias
    else:
        y = F.linear(x2, weight.to(x.dtype) * weight.scale.to(x.dtype)[:, None], bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])
