"""GPTQ and AWQ checkpoints (safetensors with a `quantization_config`): each quantized linear's
`qweight` / `qzeros` / `scales` (/ `g_idx`) decoded into BlockQuantized (integers, and per group
of inputs a scale and min, `w = q * scale + min` with min = -scale * zero), so the layers pack them
for the int4 kernels as they pack a GGUF's blocks (quant/apply.py) and the packed shard is cached
like every quantized checkpoint (quant_checkpoint.py).

Layouts (as AutoGPTQ / GPTQModel and AutoAWQ write them):
- GPTQ: qweight int32 [in / (32 / bits), out], values packed along the inputs, lowest bits first;
  qzeros int32 [groups, out / (32 / bits)] packed along the outputs; scales fp16 [groups, out];
  g_idx int32 [in] (the group of each input). checkpoint_format "gptq" (v1) stores zero - 1.
- AWQ (version "gemm"): qweight int32 [in, out / 8] and qzeros int32 [groups, out / 8], packed
  along the outputs in the order 0, 2, 4, 6, 1, 3, 5, 7; scales fp16 [groups, out]; 4 bits.

GPTQ with act-order (`desc_act`) puts an input's group in g_idx, not in its position: the
columns are held sorted by group (`input_order`, the kernels take x[:, input_order]), so each
group is contiguous as the int4 kernels need. Where that cannot hold (a group without exactly
group_size inputs; a row-parallel shard under tensor parallelism, whose inputs cut groups; q, k
and v in different orders) the weight is its exact float values.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from engine.errors import InvalidRequestError
from engine.layers.quant.blocks import BlockQuantized

METHODS = ("gptq", "awq")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's nibble order within an int32
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class CheckpointQuantization:
    method: str  # "gptq" | "awq"
    bits: int
    group_size: int  # -1: one group over all inputs
    sym: bool = True
    desc_act: bool = False
    zeros_minus_one: bool = True  # GPTQ v1 stores zero - 1


def checkpoint_quantization(hf_config: object) -> CheckpointQuantization | None:
    """The checkpoint's `quantization_config`, checked against what is implemented; None for a
    float checkpoint."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise InvalidRequestError(
            f"the checkpoint's quantization_config.quant_method {method!r} is not supported (supported: {', '.join(METHODS)})"
        )
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or bits != 4:
            raise InvalidRequestError(
                f"AWQ checkpoints load in the 'gemm' layout with 4 bits; this one has version {version!r}, {bits} bits"
            )
        return CheckpointQuantization("awq", 4, group, sym=not qc.get("zero_point", True), zeros_minus_one=False)
    if bits not in (4, 8):
        raise InvalidRequestError(f"GPTQ checkpoints load with 4 or 8 bits; this one has {bits}")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise InvalidRequestError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    return CheckpointQuantization(
        "gptq", bits, group, bool(qc.get("sym", True)), bool(qc.get("desc_act", False)), zeros_minus_one=fmt == "gptq"
    )


def _unpack(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words -> their 32 / bits values (unsigned), along `dim` (each word's values side by
    side, lowest bits first or in `order`)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if order is not None:
        shifts = shifts[torch.tensor([order.index(i) for i in range(per)])]
    v = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per]
    if dim == 0:
        return v.permute(0, 2, 1).reshape(packed.shape[0] * per, packed.shape[1])
    return v.reshape(packed.shape[0], packed.shape[1] * per)


def decode_linear(parts: dict[str, torch.Tensor], q: CheckpointQuantization) -> BlockQuantized | torch.Tensor:
    """One linear's tensors -> BlockQuantized [out, in] (or its exact float32 values for an
    act-order weight whose groups are not contiguous)."""
    scales = parts["scales"].float()  # [groups, out]
    if q.method == "awq":
        iw = _unpack(parts["qweight"], 4, 1, _AWQ_ORDER)  # [in, out]
        zeros = _unpack(parts["qzeros"], 4, 1, _AWQ_ORDER)
    else:
        iw = _unpack(parts["qweight"], q.bits, 0)  # [in, out]
        zeros = _unpack(parts["qzeros"], q.bits, 1) + (1 if q.zeros_minus_one else 0)
    n_in, n_out = iw.shape
    zeros = zeros[:, :n_out].float()
    groups = scales.shape[0]
    group = n_in // groups
    if group * groups != n_in:
        raise ValueError(f"{n_in} inputs do not split into {groups} groups")
    g_idx = parts.get("g_idx")
    plain = torch.arange(n_in) // group
    order = None
    if g_idx is not None and not torch.equal(g_idx.long(), plain):
        order = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[order], plain):  # groups of unequal sizes
            gi = g_idx.long()
            return ((iw.float() - zeros[gi]) * scales[gi]).t().contiguous()
        iw = iw[order]
    minimum = -(scales * zeros)  # exact: an fp16 scale times a small integer
    qv = iw.t().contiguous()
    if q.bits == 8:  # 0..255 held as int8 q - 128, the min moved by 128 scales (exact)
        qv, minimum, kind = (qv - 128).to(torch.int8), minimum + 128 * scales, "gptq8"
    else:
        qv, kind = qv.to(torch.uint8), q.method
    return BlockQuantized(qv, scales.t().contiguous(), minimum.t().contiguous(), q.bits, kind, group, order)


def iterate_quantized_weights(files: list[Path], q: CheckpointQuantization) -> Iterator[tuple[str, object]]:
    """(HF name, tensor or BlockQuantized): a quantized linear's parts gathered across shards
    and decoded once all are read; every other tensor as it is."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            where.update({k: f for k in fh.keys()})
    linears = sorted({k.rsplit(".", 1)[0] for k in where if k.endswith(".qweight")})

    def read(key: str) -> torch.Tensor:
        with safe_open(str(where[key]), framework="pt") as fh:
            return fh.get_tensor(key)

    for prefix in linears:
        parts = {p: read(f"{prefix}.{p}") for p in _PARTS if f"{prefix}.{p}" in where}
        missing = {"qweight", "qzeros", "scales"} - set(parts)
        if missing:
            raise ValueError(f"{prefix}: a {q.method} linear needs {sorted(missing)}")
        try:
            yield f"{prefix}.weight", decode_linear(parts, q)
        except ValueError as e:
            raise ValueError(f"{prefix}: {e}") from None
    quantized = {f"{p}.{part}" for p in linears for part in _PARTS}
    for key in where:
        if key not in quantized:
            yield key, read(key)
