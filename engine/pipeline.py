"""Pipeline parallelism's plan: which layers each stage holds (pipeline_group.py: how hidden
states cross a stage boundary). No torch here: the serving layer's config parses partitions.

A replica of `pp` stages x `tp` ranks has global ranks `stage * tp + tp_rank`; rank 0 (stage 0,
tp rank 0) runs in the driver. Stage s holds a contiguous run of decoder layers; the first also
the embedding, the last the final norm and the LM head (and samples, on its tp rank 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.engine_args import EngineArgs


def parse_partition(value: tuple[int, ...] | list[int] | str | None) -> tuple[int, ...] | None:
    """Layers per stage from "14,16" or a sequence; None stays None (an even split)."""
    if value is None or value == "":
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        parts = tuple(int(x) for x in items)
    except (TypeError, ValueError):
        raise InvalidRequestError(
            f"pipeline_partition must be layer counts like '14,16', got {value!r}", param="pipeline_partition"
        ) from None
    return parts


def stage_layer_ranges(num_layers: int, pp: int, partition: tuple[int, ...] | None = None) -> list[range]:
    """The decoder layers of each stage. Even by default; a remainder goes to the earliest
    stages, since the last one also runs the LM head (the larger matmul on most models)."""
    if partition is None:
        if num_layers < pp:
            raise InvalidRequestError(
                f"pipeline_parallel_size={pp} needs at least {pp} layers; the model has {num_layers}",
                param="pipeline_parallel_size",
            )
        base, extra = divmod(num_layers, pp)
        partition = tuple(base + (1 if s < extra else 0) for s in range(pp))
    if len(partition) != pp or any(n < 1 for n in partition) or sum(partition) != num_layers:
        raise InvalidRequestError(
            f"pipeline_partition {list(partition)} must give each of {pp} stages at least one layer "
            f"and sum to the model's {num_layers} layers",
            param="pipeline_partition",
        )
    ranges, start = [], 0
    for n in partition:
        ranges.append(range(start, start + n))
        start += n
    return ranges


def check_pipeline_features(args: EngineArgs) -> None:
    """Refuse, before any rank starts, what pp > 1 does not run: features whose state lives per
    layer outside the stage split (adapters, the offload tier) or that run a second model."""
    if args.pipeline_parallel_size == 1:
        return
    from engine.spec_decode.config import SpeculativeConfig

    spec = SpeculativeConfig.from_value(args.speculative_config)
    refused = [
        (args.enable_lora, "enable_lora"),
        (args.kv_offload_bytes > 0, "kv_offload_bytes > 0"),
        (spec is not None and spec.uses_draft_model, f"speculative method {spec.method if spec else ''!r}"),
    ]
    names = [name for on, name in refused if on]
    if names:
        raise InvalidRequestError(
            f"pipeline_parallel_size={args.pipeline_parallel_size} does not support {', '.join(names)}; "
            "use pipeline_parallel_size=1 for them (n-gram speculation works with pipeline stages)",
            param="pipeline_parallel_size",
        )
