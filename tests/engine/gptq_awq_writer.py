"""GPTQ and AWQ checkpoints made in tests from a float HF directory: each decoder linear quantized
round-to-nearest per group (asymmetric, or GPTQ's symmetric zero of 2^(bits-1)), packed as
AutoGPTQ / AutoAWQ pack it, with a `quantization_config`; beside it, the same weights
dequantized in float (the reference the quantized engine must reproduce)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _quantize(w: torch.Tensor, bits: int, groups_of: torch.Tensor, n_groups: int, sym: bool):
    """w [out, in]; groups_of [in] -> q [out, in], scales [groups, out] (fp16), zeros [groups, out]."""
    top = 2**bits - 1
    scales = torch.empty(n_groups, w.shape[0])
    zeros = torch.empty(n_groups, w.shape[0])
    for g in range(n_groups):
        cols = w[:, groups_of == g]
        if sym:
            s, z = cols.abs().amax(1) / (top / 2), torch.full((w.shape[0],), float(2 ** (bits - 1)))
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = (hi - lo) / top
            z = torch.round(-lo / s.clamp_min(1e-12))
        scales[g], zeros[g] = s.clamp_min(1e-6).half().float(), z.clamp(1, top)  # GPTQ v1 stores zero - 1
    s, z = scales[groups_of].t(), zeros[groups_of].t()
    q = torch.round(w / s + z).clamp(0, top)
    return q.int(), scales.half(), zeros.int()


def _pack(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned values -> int32 words of 32 / bits values along `dim` (lowest bits first, or value
    i of a word at position order[i])."""
    per = 32 // bits
    v = values.t() if dim == 0 else values
    v = v.reshape(v.shape[0], -1, per).to(torch.int64)
    pos = torch.tensor(order if order else range(per))
    words = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i in range(per):
        words |= v[:, :, pos[i]] << (bits * i)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.t().contiguous() if dim == 0 else words


def write_quantized(
    src: Path,
    dst: Path,
    reference: Path,
    method: str,
    bits: int = 4,
    group: int = 32,
    sym: bool = False,
    desc_act: bool = False,
    checkpoint_format: str = "gptq",
    shared_order: bool = True,
) -> None:
    """`dst`: the quantized checkpoint; `reference`: the float checkpoint of its exact values.
    Act-order (`desc_act`): linears that read the same input (q, k, v; gate, up) share one order,
    as GPTQ's Hessian of that input gives them, unless `shared_order` is False."""
    for d in (dst, reference):
        shutil.copytree(src, d, dirs_exist_ok=True)
        (d / "model.safetensors").unlink()
    state = load_file(str(src / "model.safetensors"))
    quantized, floats = {}, {}
    gen = torch.Generator().manual_seed(0)
    orders: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        prefix, _, kind = name.rpartition(".")
        if kind != "weight" or prefix.rsplit(".", 1)[-1] not in LINEARS:
            quantized[name] = floats[name] = w
            continue
        n_in = w.shape[1]
        g = group if group > 0 else n_in
        n_groups = n_in // g
        if desc_act:  # act-order: an input's group is g_idx's, not its position's
            proj = prefix.rsplit(".", 1)[-1]
            same = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
            reads = prefix.rsplit(".", 2)[0] + "." + same.get(proj, proj)
            if reads not in orders or not shared_order:
                orders[reads] = torch.argsort(torch.randperm(n_in, generator=gen))
            g_idx = (orders[reads] // g).int()
        else:
            g_idx = (torch.arange(n_in) // g).int()
        q, scales, zeros = _quantize(w.float(), bits, g_idx.long(), n_groups, sym)
        floats[name] = ((q - zeros.t()[:, g_idx.long()]) * scales.float().t()[:, g_idx.long()]).to(w.dtype)
        if method == "awq":
            quantized[f"{prefix}.qweight"] = _pack(q.t(), 4, 1, AWQ_ORDER)  # [in, out / 8]
            quantized[f"{prefix}.qzeros"] = _pack(zeros, 4, 1, AWQ_ORDER)
        else:
            stored = zeros - 1 if checkpoint_format == "gptq" else zeros
            quantized[f"{prefix}.qweight"] = _pack(q.t(), bits, 0)  # [in / per, out]
            quantized[f"{prefix}.qzeros"] = _pack(stored & (2**bits - 1), bits, 1)
            quantized[f"{prefix}.g_idx"] = g_idx
        quantized[f"{prefix}.scales"] = scales
    save_file(quantized, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(floats, str(reference / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    if method == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                      "version": "gemm"}  # fmt: skip
    else:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
                                      "desc_act": desc_act, "checkpoint_format": checkpoint_format}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(cfg))
