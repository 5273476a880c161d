"""A model's config against what the engine implements, before anything loads: a field that
changes the math and that the engine does not implement is refused with a ValueError naming it,
so a model that loads computes what transformers computes.

Implemented elsewhere, so accepted here: tied embeddings, attention and MLP biases, head_dim,
GQA/MQA, RoPE types default/linear/llama3 (per layer type for Gemma 3), partial rotary, per-head
q/k norms (Qwen3, Gemma 3), and a sliding window, which build_model_config honours by capping
max_model_len at the window (every sequence then fits the window, where windowed and full
attention agree).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.layers.rotary import LAYER_TYPES, ROPE_TYPES, rope_parameters, rotary_dim_of
from engine.model.architectures import Architecture, architecture_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Fields with no implementation in the engine; None, 0 or False in the config leaves the math alone.
# Gemma's layer soft-caps (model/gemma.py); no other architecture reads these.
_GEMMA_ONLY = ("attn_logit_softcapping", "final_logit_softcapping")
_UNIMPLEMENTED = (
    "dual_chunk_attention_config",
    "use_bidirectional_attention",
)
_LAYER_TYPES = set(LAYER_TYPES)


def check_model_config(config: PretrainedConfig) -> Architecture:
    """The config's architecture; ValueError naming the first field the engine cannot honour."""
    arch = architecture_of(config)
    act = getattr(config, arch.act_field, None) or "silu"
    if act != arch.hidden_act:
        raise ValueError(f"{arch.act_field}={act!r} is not supported for {arch.name} (only {arch.hidden_act!r})")
    unknown = set(getattr(config, "layer_types", None) or ()) - _LAYER_TYPES
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not supported (only {sorted(_LAYER_TYPES)})")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for layer_type in sorted(set(getattr(config, "layer_types", None) or ()) | {"full_attention"}):
        _check_rope(rope_parameters(config, layer_type), head_dim)
    for name in _UNIMPLEMENTED + (() if arch.gemma else _GEMMA_ONLY):
        if getattr(config, name, None):
            raise ValueError(f"{name}={getattr(config, name)!r} is not supported for {arch.name}")
    return arch


def sliding_window_of(config: PretrainedConfig) -> int | None:
    """The window of the config's sliding layers, None where no layer slides: any
    `sliding_attention` in `layer_types` (Gemma 3, which has no `use_sliding_window`), or a
    `sliding_window` that `use_sliding_window` (absent: Mistral, true) does not turn off."""
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ())
    return window if window and (sliding or getattr(config, "use_sliding_window", True)) else None


def _check_rope(rope: dict, head_dim: int) -> None:
    if rope["rope_type"] not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope['rope_type']!r} is not supported (rope_scaling / rope_parameters "
            f"must be one of: {', '.join(ROPE_TYPES)})"
        )
    rotary = rotary_dim_of(head_dim, rope)
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise ValueError(
            f"partial_rotary_factor={rope['partial_rotary_factor']} gives a rotary width of {rotary} "
            f"for head_dim {head_dim} (it must be even and at most head_dim)"
        )
