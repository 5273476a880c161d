"""The message rank 0 (the driver, in the engine's process) sends ranks 1..tp-1 each step.

Pickled once per step by the driver for all ranks (`RemoteRanks.submit`); the ranks reply
nothing (they do not sample: rank 0's sampled tokens reach them in the next message).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.scheduler_output import SchedulerOutput


@dataclass
class StepInput:
    so: SchedulerOutput  # the scheduler's delta for this step (ARCHITECTURE.md, rule 1)
    # request id -> token ids rank 0 sampled in the previous step (applied by ranks != 0).
    prev_sampled: dict[str, list[int]] = field(default_factory=dict)
