"""Pipeline parallelism: which layers each stage holds, and how hidden states cross a stage
boundary.

A replica of `pp` stages x `tp` ranks has global ranks `stage * tp + tp_rank`; rank 0 (stage 0,
tp rank 0) runs in the driver. Stage s holds a contiguous run of decoder layers; the first also
the embedding, the last the final norm and the LM head (and samples, on its tp rank 0). Each tp
rank of a stage sends the stage's output to the same tp rank of the next stage (point-to-point
over the replica's world process group: gloo on CPU, NCCL on CUDA) and the receiving stage
starts its layers from it. The Ray side (workers/) builds the groups; the engine only uses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

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


@dataclass
class PPGroup:
    """This rank's place in the pipeline. pp=1: one stage holding every layer."""

    size: int = 1
    stage: int = 0
    layers: range | None = None  # this stage's decoder layers; None: all
    group: object | None = None  # the world process group (global ranks), pp > 1
    prev_rank: int | None = None  # global rank this one receives from
    next_rank: int | None = None  # global rank this one sends to
    _send: object | None = None  # the last send's work and its buffer, waited before the next

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def holds_layer(self, i: int) -> bool:
        return self.layers is None or i in self.layers

    def send(self, x: torch.Tensor) -> None:
        """Hand this stage's output to the next stage without waiting for it to arrive; the
        previous send is completed first (one in flight, its buffer kept alive until then)."""
        self.wait_sent()
        x = x.contiguous()
        self._send = (self.group.send([x], self.next_rank, 0), x)

    def wait_sent(self) -> None:
        if self._send is not None:
            work, _ = self._send
            self._send = None
            work.wait()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=device)
        self.group.recv([x], self.prev_rank, 0).wait()
        return x


def make_pp_group(stage: int, tp_rank: int, tp: int, pp: int, layers: range, group: object | None) -> PPGroup:
    return PPGroup(
        size=pp,
        stage=stage,
        layers=layers,
        group=group,
        prev_rank=(stage - 1) * tp + tp_rank if stage > 0 else None,
        next_rank=(stage + 1) * tp + tp_rank if stage < pp - 1 else None,
    )
