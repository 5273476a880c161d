"""A pipeline stage's place among the stages and the hand-off of hidden states across a stage
boundary (engine/pipeline.py: the plan): each tp rank of a stage sends the stage's output to the
same tp rank of the next stage, point-to-point over the replica's world process group (gloo on
CPU, NCCL on CUDA), and the receiving stage starts its layers from it. The Ray side (workers/)
builds the groups; the engine only uses them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
