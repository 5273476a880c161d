"""A decode step of a few rows through all decoder layers in one C++ call (`DecodeLayers`,
engine/kernels/cpu/decode_layers.cpp).

At one row a step is ~300 small ops; the Python modules, the dispatcher and each op's checks
around them cost about as much as the kernels (`python -m bench.bench_fused_decode`). The C++ call
runs the very ops the layers call, in the same order on the same values, so its hidden states are
bit-identical (tests/engine/test_fused_decode.py). It applies where every layer would take the
C++ path anyway: CPU, tensor parallel size 1, the `cpu_paged` attention backend with a cache in
the model's dtype or int8, the few-row linear op for every weight (float, or PyTorch's int4
pack), Llama's q/k math (no q/k norms, whole heads rotated: `LlamaAttention.llama_math`), and
a step of decode tokens only, no more than every linear's few-row op takes (float weights:
packed_gemm.small_rows(), 4 rows, or 64 for bf16 ones where the bf16 GEMM is emulated; int4
ones: quant/int4.small_rows()). Anything else runs the layers as modules.
`ORBITAL_FUSED_DECODE=0` turns it off.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from engine.layers.attention.cpu_paged import CpuPagedAttentionBackend
from engine.layers.packed_gemm import OP_ROWS, _vector_ops, small_linear_ops, small_rows
from engine.model.llama_layers import LlamaDecoderLayer
from engine.model.pipeline_stage import MissingLayer
from engine.runner.forward_context import get_attn_metadata

if TYPE_CHECKING:
    from engine.model.llama import LlamaModel


def _linear_parts(module: torch.nn.Module, dtype: torch.dtype) -> tuple | None:
    """(weight, int4 scales or None, bias or None, group size, out features, 5-bit high bits or
    None, int8 activations) as the module's few-row path calls its op; None where the module would not take that path (asked of the op
    itself on a zero row: it declines some shapes, and the module then runs another kernel)."""
    parts = _linear_candidate(module)
    if parts is None or getattr(module.weight, "input_order", None) is not None:
        return None  # act-order weights take their inputs reordered: the layers' own path does
    w, scales, bias, group_size, n, hi_bits, int8_x = parts
    ops = small_linear_ops()
    k = module.input_size_per_partition if hasattr(module, "input_size_per_partition") else module.input_size
    x, y = torch.zeros(1, k, dtype=dtype), torch.empty(1, n, dtype=dtype)
    if scales is not None:
        from engine.layers.quant.int4_format import pack_layout

        ok = ops.int4_small_linear(x, w, scales, group_size, pack_layout()[1], None, y, hi_bits, int8_x)
    else:
        ok = ops.small_linear(x, w, bias, y)
    return parts if ok else None


def _few_rows(weight: torch.Tensor, int4_scales: torch.Tensor | None) -> int:
    """Rows up to which the module runs its few-row op: int4 weights' limit or float ones' (all,
    OP_ROWS per call, for a bf16 weight where the bf16 GEMM is emulated; one call here)."""
    from engine.layers.quant import int4

    if int4_scales is not None:
        return int4.small_rows()
    rows = small_rows(weight)
    return OP_ROWS if rows is None else rows


def _linear_candidate(module: torch.nn.Module) -> tuple | None:
    w = module.weight
    bias = getattr(module, "bias", None)
    if getattr(module, "tp_size", 1) != 1:
        return None
    if w.dtype == torch.uint8:
        from engine.layers.quant.int4 import op_scales
        from engine.layers.quant.int4 import small_linear_ops as int4_ops

        if int4_ops() is None:
            return None
        hi_bits, int8_x = getattr(w, "hi_bits", None), getattr(w, "int8_activations", False)
        return w.data, op_scales(w), bias, w.group_size, w.out_features, hi_bits, int8_x
    if w.dtype not in (torch.float32, torch.bfloat16):
        return None
    plain, ops = (getattr(w, "plain", None), _vector_ops(True)) if w.is_mkldnn else (w, small_linear_ops())
    if plain is None or ops is None:
        return None
    return (
        plain,
        None,
        bias,
        0,
        plain.out_features if plain.dim() == 3 else plain.shape[0],
        None,
        False,
    )  # 3: bf16 panels


def _elementwise_ops_apply(ops: object, model: LlamaModel) -> bool:
    """Whether rms_norm, rotary and silu_and_mul take this model's rows (each declines some head
    sizes and widths, and the layers then run PyTorch's version): asked once, on a dummy row."""
    layer = _local_layers(model)[0]
    sa, dtype = layer.self_attn, layer.input_layernorm.weight.dtype
    hidden = layer.input_layernorm.weight.shape[0]
    width = (sa.qkv_proj.num_heads + 2 * sa.qkv_proj.num_kv_heads) * sa.head_dim
    inter = sum(layer.mlp.gate_up_proj.output_sizes) // 2
    heads = sa.qkv_proj.num_heads + sa.qkv_proj.num_kv_heads
    positions = torch.zeros(1, dtype=torch.int64)
    return (
        ops.rms_norm(torch.ones(1, hidden, dtype=dtype), None, layer.input_layernorm.weight, 1e-6)
        and ops.rotary(torch.zeros(1, width, dtype=dtype), positions, sa.rotary.cos, sa.rotary.sin, heads, sa.head_dim)
        and ops.silu_and_mul(torch.zeros(1, 2 * inter, dtype=dtype), torch.empty(1, inter, dtype=dtype))
    )


def _local_layers(model: LlamaModel) -> list[torch.nn.Module]:
    """The decoder layers this pipeline stage holds (all at pp=1)."""
    return [layer for layer in model.layers if not isinstance(layer, MissingLayer)]


def _linears(layer: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]


class FusedDecode:
    """Built once per model (`for_model`); `run` returns (hidden, residual) after the last
    decoder layer, or None where this step is not one it covers."""

    def __init__(self, model: LlamaModel, program: object, max_rows: int) -> None:
        self.layers = _local_layers(model)
        self.program = program
        self.dtype = self.layers[0].input_layernorm.weight.dtype
        self.max_rows = max_rows  # the fewest rows any of its linears' few-row ops take

    @staticmethod
    def for_model(model: LlamaModel) -> FusedDecode | None:
        if os.environ.get("ORBITAL_FUSED_DECODE", "1") == "0":
            return None
        ops = small_linear_ops()
        layers = _local_layers(model)
        dtype = layers[0].input_layernorm.weight.dtype
        if ops is None or not hasattr(ops, "DecodeLayers") or layers[0].input_layernorm.weight.device.type != "cpu":
            return None
        norms, parts, rows = [], [], []
        for layer in layers:
            if not isinstance(layer, LlamaDecoderLayer):
                return None  # Gemma's (model/gemma.py): four (1 + weight) norms, GeGLU
            if not hasattr(layer.mlp, "gate_up_proj"):
                return None  # a mixture-of-experts layer: its experts run one by one
            if any(m.lora is not None for m in _linears(layer)):
                return None  # LoRA deltas (engine/lora/) run in the modules
            attn = layer.self_attn
            if not isinstance(attn.attn.backend, CpuPagedAttentionBackend) or not attn.llama_math:
                return None
            got = [_linear_parts(m, dtype) for m in _linears(layer)]
            if any(p is None for p in got):
                return None
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            parts += got
            rows += [_few_rows(m.weight, p[1]) for m, p in zip(_linears(layer), got)]
        sa = layers[0].self_attn
        if not _elementwise_ops_apply(ops, model):
            return None
        eps = {layer.input_layernorm.eps for layer in layers} | {layer.post_attention_layernorm.eps for layer in layers}
        if len(eps) != 1:
            return None
        from engine.layers.quant.int4_format import pack_layout

        program = ops.DecodeLayers(
            norms,
            [p[0] for p in parts],
            [p[1] for p in parts],
            [p[2] for p in parts],
            [p[3] for p in parts],
            [p[4] for p in parts],
            [p[5] for p in parts],
            [p[6] for p in parts],
            pack_layout()[1],
            sa.qkv_proj.num_heads,
            sa.qkv_proj.num_kv_heads,
            sa.head_dim,
            eps.pop(),
            sa.attn.scale,
            sa.rotary.cos,
            sa.rotary.sin,
        )
        return FusedDecode(model, program, min(rows))

    def run(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        meta = get_attn_metadata()
        t = x.shape[0]
        if (
            meta is None
            or not 0 < t <= self.max_rows
            or meta.prefills
            or meta.num_decode_tokens != t
            or x.dtype != self.dtype
            or positions.dtype != torch.int64
        ):
            return None
        caches = [layer.self_attn.attn.kv_cache for layer in self.layers]
        if any(c is None or (c.dtype != torch.int8 and c.dtype != x.dtype) for c in caches):
            return None
        return self.program.run(x, positions, caches, meta.decode_block_table, meta.decode_seq_lens, meta.slot_mapping)
