"""A rank's quantized weights saved once, so the next start with the same settings skips
quantizing (or decoding GGUF blocks): safetensors under the cache root, keyed by the source
weights' identity (paths, sizes, mtimes), the quantization, the dtype, the TP rank/size, and
the pack's device (on CPU, PyTorch's pack layout, which differs between AVX-512 and AVX2; on
CUDA, the kernel choice).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from engine.layers.quant import is_quantized
from engine.model.gguf_convert import cache_root

# Bump when what a quantization produces changes (3: CPU int4's scale_min; 6: int8 as two
# nibbles, bf16 scales; 7: two nibbles on the 32-row (AVX2) pack too; 8: scale_min blocked by 64 rows;
# 9: 5-bit GGUF values as nibbles and high bits).
FORMAT = 9
_ATTRS = (
    "scale",
    "scale_bf16",
    "scale_min",
    "scales_zeros_bf16",
    "rows",
    "input_order",
    "hi_bits",
)  # tensors that travel with a quantized weight
_META = ("group_size", "two_nibbles", "out_features", "centered")


def cache_path(
    sources: list[Path],
    quantization: str,
    dtype: torch.dtype,
    tp_rank: int,
    tp_size: int,
    device: str = "cpu",
    stage_layers: range | None = None,
) -> Path:
    """`stage_layers`: a pipeline stage's decoder layers (pp > 1), which its shard holds alone."""
    ident = [FORMAT, quantization, str(dtype), tp_rank, tp_size]
    if stage_layers is not None:
        ident.append([stage_layers.start, stage_layers.stop])
    if device == "cpu":  # PyTorch's CPU int4 pack is laid out per its vector code (int4_format.pack_layout)
        from engine.layers.quant.int4_format import pack_layout

        ident.append(list(pack_layout()))
    else:  # CUDA's int4 forms are other layouts again, one per kernel choice
        from engine.layers.quant.cuda_kernel_choice import cuda_quant_kernel

        ident += [device, cuda_quant_kernel("int4")]
    for f in sources:
        st = f.stat()
        ident.append(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    key = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:20]
    return (
        cache_root()
        / "quantized"
        / f"{sources[0].stem}-{quantization.replace(':', '-')}-tp{tp_size}r{tp_rank}-{key}.safetensors"
    )


def _slots(model: nn.Module):
    """(module, attribute, key) of every weight a quantized model holds; a tied head's weight is
    its embedding's and is skipped (re-tied on load)."""
    for mname, module in model.named_modules():
        for attr in ("weight", "bias", "packed_weight"):
            t = getattr(module, attr, None)
            if t is None or not isinstance(t, torch.Tensor) or (attr == "weight" and getattr(module, "tied", False)):
                continue
            yield module, attr, f"{mname}.{attr}" if mname else attr


def save(model: nn.Module, path: Path) -> None:
    from safetensors.torch import save_file

    state, meta = {}, {}
    for module, attr, key in _slots(model):
        t = getattr(module, attr)
        state[key] = t.data.contiguous()
        if is_quantized(t):
            meta[key] = {a: t.__dict__[a] for a in _META if a in t.__dict__}
            for a in _ATTRS:
                if t.__dict__.get(a) is not None:
                    state[f"{key}.{a}"] = getattr(t, a).contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file(state, str(tmp), metadata={"orbital_quantized": json.dumps(meta)})
    os.replace(tmp, path)


def load(model: nn.Module, path: Path) -> None:
    """Fill a freshly built (unloaded) model from `save`'s file."""
    from safetensors import safe_open

    device = next(model.parameters()).device
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        meta = json.loads(f.metadata()["orbital_quantized"])
        keys = set(f.keys())
        for mname, module in list(model.named_modules()):
            for attr in ("weight", "bias", "packed_weight"):
                key = f"{mname}.{attr}" if mname else attr
                if key not in keys:
                    continue
                # Copies: the file's tensors map it at any offset, and the kernels met unaligned
                # weights with a segfault (a test did, at an offset of 40 bytes).
                t = f.get_tensor(key).clone()
                if key in meta:
                    p = nn.Parameter(t, requires_grad=False)
                    for a in _ATTRS:
                        setattr(p, a, f.get_tensor(f"{key}.{a}").clone() if f"{key}.{a}" in keys else None)
                    for a, v in meta[key].items():
                        setattr(p, a, v)
                    setattr(module, attr, p)
                else:
                    getattr(module, attr).data = t
    head = getattr(model, "lm_head", None)
    if head is not None and head.tied:
        head.weight = head.tied_embedding.weight
