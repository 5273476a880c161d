"""A model's config against what the engine implements, before anything loads: a field that
changes the math and that the engine does not implement is refused with a ValueError naming it,
so a model that loads computes what transformers computes.

Implemented elsewhere, so accepted here: tied embeddings, attention and MLP biases, head_dim,
GQA/MQA, RoPE types default/linear/llama3, partial rotary, per-head q/k norms (Qwen3), and a
sliding window, which build_model_config honours by capping max_model_len at the window (every
sequence then fits the window, where windowed and full attention agree).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.layers.rotary import ROPE_TYPES, rope_parameters, rotary_dim_of
from engine.model.architectures import Architecture, architecture_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Fields with no implementation in the engine; None, 0 or False in the config leaves the math alone.
_UNIMPLEMENTED = ("attn_logit_softcapping", "final_logit_softcapping", "dual_chunk_attention_config")
_LAYER_TYPES = {"full_attention", "sliding_attention"}


def check_model_config(config: PretrainedConfig) -> Architecture:
    """The config's architecture; ValueError naming the first field the engine cannot honour."""
    arch = architecture_of(config)
    act = getattr(config, "hidden_act", None) or "silu"
    if act != arch.hidden_act:
        raise ValueError(f"hidden_act={act!r} is not supported for {arch.name} (only {arch.hidden_act!r})")
    rope = rope_parameters(config)
    if rope["rope_type"] not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope['rope_type']!r} is not supported (rope_scaling / rope_parameters "
            f"must be one of: {', '.join(ROPE_TYPES)})"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary = rotary_dim_of(head_dim, rope)
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise ValueError(
            f"partial_rotary_factor={rope['partial_rotary_factor']} gives a rotary width of {rotary} "
            f"for head_dim {head_dim} (it must be even and at most head_dim)"
        )
    for name in _UNIMPLEMENTED:
        if getattr(config, name, None):
            raise ValueError(f"{name}={getattr(config, name)!r} is not supported for {arch.name}")
    unknown = set(getattr(config, "layer_types", None) or ()) - _LAYER_TYPES
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not supported (only {sorted(_LAYER_TYPES)})")
    return arch
