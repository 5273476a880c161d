"""One loaded weight -> its quantized form for a QuantSpec (what each layer's
`quantize_weights` calls on its own shard)."""

from __future__ import annotations

import torch

from engine.layers.quant.blocks import BlockQuantized, assemble
from engine.layers.quant.cuda_int4 import pack_int4_cuda
from engine.layers.quant.int4 import five_bit_runs, small_linear_ops
from engine.layers.quant.int4_format import group_size_for, pack_int4, quantize_groups, quantize_int4
from engine.layers.quant.int8 import quantize_int8
from engine.layers.quant.spec import QuantSpec


def has_blocks(param: torch.Tensor) -> bool:
    return bool(getattr(param, "block_parts", None))


def quantize_param(param: torch.Tensor, spec: QuantSpec, keep_rows: bool = False) -> torch.Tensor:
    """GGUF blocks the loader left on the parameter are packed as they are (5-bit values as nibbles
    and high bits where the CPU ops run them, other 8-bit values as two nibbles: int4_format.py), or written out as float where float rows share the parameter; a
    float weight is quantized per `spec` ("gguf": stays float).
    On CUDA int4 goes to tinygemm's pack (cuda_int4.py; `keep_rows`: an embedding's lookup
    needs plain rows too); int8 runs int8.py's kernels, or the int4 op as two nibbles where that
    runs (int8_as_nibbles)."""
    cuda = param.device.type == "cuda"
    if has_blocks(param):
        try:
            w = assemble(param.block_parts, param.shape[0])
        except ValueError:  # act-order pieces (q, k, v) whose inputs are in different orders
            return _as_float(param)
        if getattr(param, "has_float_rows", False) or (cuda and w.group not in CUDA_GROUPS):
            return _as_float(param)
        five = None if cuda or not five_bit_runs() else w.as_five_bits()
        if five is not None:
            nibbles, hi_bits, scale, minimum = five
            packed = pack_int4(nibbles, scale, minimum, w.group, hi_bits=hi_bits)
        elif cuda:
            q, scale, minimum = (t.to(param.device) for t in w.as_nibbles(split=w.bits == 8))
            packed = pack_int4_cuda(q, scale, minimum, w.group, split=w.bits == 8, keep_rows=keep_rows)
        else:
            packed = pack_int4(*w.as_nibbles(split=w.bits == 8), w.group, split=w.bits == 8)
        packed.input_order = None if w.input_order is None else w.input_order.to(packed.device)
        return packed
    if spec.method == "int8":
        return int8_as_nibbles(quantize_int8(param))
    if spec.method == "int4":
        group = group_size_for(param.shape[1], spec.group_size)
        if cuda:
            return pack_int4_cuda(*quantize_groups(param, group), group, keep_rows=keep_rows)
        return quantize_int4(param, group)
    return param


CUDA_GROUPS = (32, 64, 128, 256)  # tinygemm's group sizes


def _as_float(param: torch.Tensor) -> torch.Tensor:
    """A parameter whose pieces are partly float and partly blocks (or blocks the device's kernel
    cannot group, or pieces in different input orders): the blocks' rows written as their exact
    float values beside the float rows."""
    for off, p in param.block_parts:
        n = p.shape[0]
        param.data[off : off + n] = p.dequantize().to(param.device, param.dtype)
    del param.block_parts
    return param


def int8_as_nibbles(q: torch.Tensor) -> torch.Tensor:
    """A CPU int8 weight (quantize_int8) in the two-nibble int4 pack where the few-row int4 op
    runs: the same int8 values and bf16 scales exactly (as a GGUF's Q8_0 weight runs), because
    that op reads them 1.2-1.7x faster than PyTorch's int8 kernel at decode (the 49152x576 head
    at 1-48 rows), keeps float32 sums where that kernel rounds its output to bf16 (logits: a step
    of 0.25 at 32-64, exact ties between top tokens, coarse logprobs), and lets the fused decode
    step take int8 models. One scale per row, repeated per group of up to 128 inputs. Else q."""
    if q.dtype != torch.int8 or q.device.type != "cpu" or small_linear_ops() is None:
        return q
    n, k = q.shape
    try:
        group = group_size_for(k, 128)
    except ValueError:
        return q
    d = q.scale[:, None].expand(n, k // group).contiguous()
    w = BlockQuantized(q.data, d, torch.zeros_like(d), 8, "int8")
    return pack_int4(*w.as_nibbles(split=True), group, split=True)


def is_quantized(w: torch.Tensor | None) -> bool:
    return w is not None and w.dtype in (torch.int8, torch.uint8, torch.int32)  # int32: CUDA's int4 pack


__all__ = ["has_blocks", "int8_as_nibbles", "is_quantized", "quantize_param"]
