"""Gated activations over a merged gate/up projection output: SiLU (Llama) and tanh-approximated
GELU (Gemma's GeGLU, `gelu_pytorch_tanh`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu_ops import cpu_ops_for


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_ops_for(x)
        if ops is not None:
            out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
            if ops.silu_and_mul(x, out):  # one pass (PyTorch: silu, then a multiply)
                return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
