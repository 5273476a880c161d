"""One loaded weight -> its quantized form for a QuantSpec (what each layer's
`quantize_weights` calls on its own shard)."""

from __future__ import annotations

import torch

from engine.layers.quant.blocks import BLOCK, assemble
from engine.layers.quant.int4 import group_size_for, pack_int4, quantize_int4
from engine.layers.quant.int8 import quantize_int8
from engine.layers.quant.spec import QuantSpec


def has_blocks(param: torch.Tensor) -> bool:
    return bool(getattr(param, "block_parts", None))


def quantize_param(param: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """GGUF blocks the loader left on the parameter are packed as they are (8-bit Q8_0 values
    as two nibbles, int4.py); a float weight is quantized per `spec` ("gguf": stays float)."""
    if has_blocks(param):
        w = assemble(param.block_parts, param.shape[0])
        q, scale, minimum = w.as_nibbles(split=w.bits == 8)
        return pack_int4(q, scale, minimum, BLOCK, split=w.bits == 8)
    if spec.method == "int8":
        return quantize_int8(param)
    if spec.method == "int4":
        return quantize_int4(param, group_size_for(param.shape[1], spec.group_size))
    return param


def is_quantized(w: torch.Tensor | None) -> bool:
    return w is not None and w.dtype in (torch.int8, torch.uint8)


__all__ = ["has_blocks", "is_quantized", "quantize_param"]
