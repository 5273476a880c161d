"""The decoder architectures the engine implements and how each differs from Llama.

Every one runs through engine/model/llama.py's attention and linears; an `Architecture` names
the differences that layer code reads (biases, per-head q/k norms, fused checkpoint tensors, and
Gemma's layer layout in engine/model/gemma.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Architecture:
    name: str
    qkv_bias: bool | None = None  # None: the config's attention_bias
    o_bias: bool | None = None  # None: the config's attention_bias
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3)
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj whole (Phi-3)
    hidden_act: str = "silu"
    act_field: str = "hidden_act"  # the config field naming the MLP activation
    # Gemma's layer (model/gemma.py): (1 + weight) RMSNorms, four per layer, scaled embeddings,
    # GeGLU, query_pre_attn_scalar, each layer type with its own RoPE, logit soft-capping
    gemma: bool = False


ARCHITECTURES = {
    a.name: a
    for a in (
        Architecture("LlamaForCausalLM"),
        Architecture("MistralForCausalLM"),
        Architecture("Qwen2ForCausalLM", qkv_bias=True, o_bias=False),
        Architecture("Qwen3ForCausalLM", qk_norm=True),
        Architecture("Phi3ForCausalLM", qkv_bias=False, o_bias=False, fused_checkpoint=True),
        # Mixture of experts (layers/moe.py; the config's expert counts say which layers).
        Architecture("MixtralForCausalLM"),
        Architecture("Qwen2MoeForCausalLM", qkv_bias=True, o_bias=False),
        Architecture("Qwen3MoeForCausalLM", qk_norm=True),
        Architecture("Gemma2ForCausalLM", gemma=True, hidden_act="gelu_pytorch_tanh", act_field="hidden_activation"),
        Architecture(
            "Gemma3ForCausalLM", qk_norm=True, gemma=True, hidden_act="gelu_pytorch_tanh", act_field="hidden_activation"
        ),
    )
}
# Architectures known and refused, with the field the engine lacks.
REFUSED: dict[str, str] = {}
SUPPORTED_ARCHITECTURES = frozenset(ARCHITECTURES)


def architecture_of(config: PretrainedConfig) -> Architecture:
    """The config's architecture (a config without `architectures` is a Llama); ValueError naming
    the field for one the engine does not implement."""
    name = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
    if name in REFUSED:
        raise ValueError(f"architectures={name!r} is not supported: {REFUSED[name]}")
    if name not in ARCHITECTURES:
        raise ValueError(
            f"architectures={name!r} is not supported; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return ARCHITECTURES[name]
