"""Per-request fault isolation: a step that raises fails the request that caused it, not the engine.

A step's exception does not say which request caused it. The requests scheduled for the first
time in that step are the suspects (a request's parameters, grammar and prompt meet the step
first there); every request of the step is rolled back like a preempted one (its KV of this
step was never written) and the suspects are quarantined. A quarantined request is scheduled as
the only new request of a step with nothing else running beside it, so a step that fails then
has exactly one culprit: it fails with a typed error (error_kind "internal") and the engine goes
on. A step that fails with no suspect, or MAX_CULPRITS_IN_A_ROW culprits without one step
succeeding between them, is a fault of the step itself (the model, the device): the engine dies,
as before, and its replica is replaced.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

MAX_CULPRITS_IN_A_ROW = 4  # isolated faults with no good step between: the step itself is broken


@dataclass
class StepFaults:
    quarantined: set[str] = field(default_factory=set)  # request ids, each to run its next step alone
    culprits_in_a_row: int = 0
    num_isolated: int = 0  # requests failed for a step they broke (EngineStats.num_request_faults)

    def suspects(self, new_ids: list[str], scheduled_ids: list[str]) -> tuple[str | None, list[str]]:
        """(the culprit if the failed step pins one down, else None; the requests to quarantine).
        A step that ran one request alone pins it; otherwise its new requests are suspects, or, with
        none, every request it ran."""
        if len(scheduled_ids) == 1:
            return scheduled_ids[0], []
        return None, list(new_ids or scheduled_ids)

    def step_ok(self, scheduled_ids: Iterable[str]) -> None:
        """Called after every good step: nothing to do unless a fault left suspects."""
        self.culprits_in_a_row = 0
        if self.quarantined:
            self.quarantined.difference_update(scheduled_ids)

    def found_culprit(self, request_id: str) -> bool:
        """Count a culprit; False when too many came in a row (the engine should die)."""
        self.quarantined.discard(request_id)
        self.culprits_in_a_row += 1
        self.num_isolated += 1
        return self.culprits_in_a_row < MAX_CULPRITS_IN_A_ROW
