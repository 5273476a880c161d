"""A PEFT LoRA adapter directory: checked against the model without reading its weights
(`check_adapter`, the engine's side), and its weights read (`read_adapter`, the workers' side).

Supported: plain LoRA (`lora_alpha / r` scaling, or `lora_alpha / sqrt(r)` with `use_rslora`) on
the attention and MLP linears of dense Llama-family layers. Refused with the reason: DoRA,
`modules_to_save`, trainable tokens, LoRA biases, per-module rank or alpha patterns,
`fan_in_fan_out`, embedding or LM-head targets, mixture-of-experts MLPs, ranks above
`max_lora_rank`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import InvalidRequestError
from engine.lora.config import TARGET_MODULES
from engine.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")

# (layer index, module name) -> (A [r, in], B [out, r])
AdapterWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AdapterInfo:
    rank: int  # the largest of its modules'
    scaling: float
    modules: frozenset[tuple[int, str]]  # (layer index, module name) it changes


def _fail(lora: LoRARequest, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}): {why}")


def _read_config(lora: LoRARequest) -> dict:
    d = Path(lora.lora_path)
    if not d.is_dir():
        raise _fail(lora, "not a directory")
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (d / f).is_file():
            raise _fail(lora, f"no {f} (a PEFT adapter saved with safe_serialization)")
    try:
        return json.loads((d / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise _fail(lora, f"{CONFIG_FILE} is not readable JSON ({e})") from e


def _scaling(lora: LoRARequest, cfg: dict) -> float:
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise _fail(lora, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    refused = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (whole trained modules)",
        "trainable_token_indices": "trainable token embeddings",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "fan_in_fan_out": "fan_in_fan_out weights",
    }
    for key, what in refused.items():
        if cfg.get(key):
            raise _fail(lora, f"{what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise _fail(lora, f"LoRA biases (bias={cfg['bias']!r}) are not supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise _fail(lora, f"r={r!r} and lora_alpha={alpha!r} must be a positive integer and a number")
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def module_shapes(hf_config: object) -> dict[str, tuple[int, int]]:
    """Module name -> (input features, output features) of the whole (unsharded) linear."""
    from engine.model.llama_layers import head_dim_of

    c, hd = hf_config, head_dim_of(hf_config)
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    h, i = c.hidden_size, c.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def check_adapter(lora: LoRARequest, hf_config: object, max_lora_rank: int) -> AdapterInfo:
    """Everything that can be refused, from the config and the tensors' names and shapes."""
    from safetensors import safe_open

    from engine.layers.moe import is_moe_layer

    cfg = _read_config(lora)
    scaling = _scaling(lora, cfg)
    shapes = module_shapes(hf_config)
    found: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    try:
        with safe_open(str(Path(lora.lora_path) / WEIGHTS_FILE), framework="pt") as f:
            for name in f.keys():
                m = _NAME.match(name)
                if m is None:
                    raise _fail(lora, f"tensor {name!r} is not a LoRA A/B weight of a decoder layer's linear")
                layer, module, ab = int(m[1]), m[2], m[3]
                found.setdefault((layer, module), {})[ab] = tuple(f.get_slice(name).get_shape())
    except InvalidRequestError:
        raise
    except Exception as e:
        raise _fail(lora, f"{WEIGHTS_FILE} is not readable ({e})") from e
    if not found:
        raise _fail(lora, "no LoRA weights")
    rank = 0
    for (layer, module), ab in found.items():
        where = f"layer {layer} {module}"
        if module not in TARGET_MODULES:
            raise _fail(lora, f"{where}: target not supported (supported: {', '.join(TARGET_MODULES)})")
        if layer >= hf_config.num_hidden_layers:
            raise _fail(lora, f"{where}: the model has {hf_config.num_hidden_layers} layers")
        if module in ("gate_proj", "up_proj", "down_proj") and is_moe_layer(hf_config, layer):
            raise _fail(lora, f"{where}: LoRA on mixture-of-experts MLPs is not supported")
        if set(ab) != {"A", "B"}:
            raise _fail(lora, f"{where}: needs both lora_A and lora_B")
        fin, fout = shapes[module]
        r = ab["A"][0]
        if ab["A"] != (r, fin) or ab["B"] != (fout, r):
            raise _fail(lora, f"{where}: A {ab['A']} and B {ab['B']} do not fit a {fin} -> {fout} linear")
        if r > max_lora_rank:
            raise _fail(lora, f"rank {r} is larger than max_lora_rank={max_lora_rank}")
        rank = max(rank, r)
    return AdapterInfo(rank, scaling, frozenset(found))


def read_adapter(lora: LoRARequest, dtype: torch.dtype) -> AdapterWeights:
    """The adapter's A and B of every module, B scaled, in `dtype` on the host (checked already
    by check_adapter on the engine's side)."""
    from safetensors.torch import load_file

    scaling = _scaling(lora, _read_config(lora))
    tensors = load_file(str(Path(lora.lora_path) / WEIGHTS_FILE))
    out: AdapterWeights = {}
    for name, t in tensors.items():
        m = _NAME.match(name)
        if m is None or m[3] != "A":
            continue
        b = tensors[name[: -len("lora_A.weight")] + "lora_B.weight"]
        out[(int(m[1]), m[2])] = (t.to(dtype), (b.float() * scaling).to(dtype))
    return out
