"""Can this model be split over `tp` ranks? Checked in the driver, before any actor starts,
so a bad tensor_parallel_size is a clear error instead of a failure inside a remote rank."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def check_tp_compatible(hf_config: PretrainedConfig, tp: int) -> None:
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    inter = hf_config.intermediate_size
    problems = []
    if heads % tp:
        problems.append(f"{heads} attention heads are not divisible by {tp}")
    if kv >= tp and kv % tp:
        problems.append(f"{kv} KV heads are not divisible by {tp}")
    if kv < tp and tp % kv:
        problems.append(f"{tp} ranks cannot replicate {kv} KV heads evenly ({tp} is not a multiple of {kv})")
    if inter % tp:
        problems.append(f"intermediate_size {inter} is not divisible by {tp}")
    if problems:
        raise InvalidRequestError(
            f"tensor_parallel_size={tp} does not fit this model: " + "; ".join(problems), param="tensor_parallel_size"
        )


def kv_heads_per_rank(hf_config: PretrainedConfig, tp: int) -> int:
    """KV heads each rank stores: kv/tp, or 1 when KV heads are replicated (kv < tp)."""
    kv = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return kv // tp if kv >= tp else 1
