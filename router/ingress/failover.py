"""Mid-stream failover: when the engine replica running a request dies or is drained, the ingress
sends the request on to another replica as a continuation, and the caller's one stream goes on.

A continuation is the same `SubmitRequest` (same id, prompt ids and parameters, so the replica
choice prefers a replica holding the prompt's prefix) with `resume`: each unfinished child
sequence and the output tokens the ingress received for it. The engine restores those outputs
(not part of the prompt) and recomputes them like a preempted request; the budget left is
`max_tokens` minus them, and seeded draws are keyed by (seed, output position), so greedy and
seeded sampling go on exactly as an uninterrupted run. Text, usage and `finish_reason` come from
the ingress's OutputProcessor, which saw the whole request.

What moves a request: its output channel failed (the replica process died, the router no longer
lists it), its replica failed it with `EngineDeadError` (engine loop died or shut down), its
`submit` failed on a dead replica, or the replica was removed (scale-down, redeploy) and the
request outlived the drain budget (`ReplicaDrainingError`). Anything else (a bad request, 429)
reaches the caller as before. At most `AppConfig.max_migrations` moves per request; past that,
or when a request's state cannot move, it fails with `MigrationFailedError` (503, or an error
event in a stream), never a silently different output. A request that was in the engine when a
step raised (`EngineStepError`) on two replicas is not moved again: it may be what kills them.
"""

from __future__ import annotations

import dataclasses
import time

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from engine.errors import EngineDeadError, EngineStepError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from router.replica_choice.request_router import ReplicaGoneError
from router.replica_choice.routing_state import routing_state


class ReplicaLostError(EngineDeadError):
    """The output channel of the replica running a request failed (process gone, unlisted)."""


class ReplicaDrainingError(EngineDeadError):
    """The replica running a request is being removed and the drain budget ran out."""


class MigrationFailedError(EngineDeadError):
    """The request's replica failed and the request could not move to another one. HTTP 503;
    the client sees `reason`, the log the replica's error."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.public_message = f"the engine replica running this request failed and it could not move: {reason}"


def _cause(exc: BaseException) -> BaseException:
    while getattr(exc, "cause", None) is not None and exc.cause is not exc:
        exc = exc.cause
    return exc


def moves_request(exc: BaseException) -> bool:
    """True when `exc` means the replica (not the request) failed: the request may move."""
    return isinstance(exc, (EngineDeadError, RayActorError)) or isinstance(
        _cause(exc), (EngineDeadError, RayActorError)
    )


def note_replica_failure(replica: str | None, exc: BaseException) -> None:
    """A replica whose process is gone is left out of every replica choice in this process
    until Serve drops it from the routers' lists (40-110 s after a SIGKILL)."""
    if replica is None:
        return
    cause = _cause(exc)
    if isinstance(cause, (ActorDiedError, ReplicaGoneError)) or (
        isinstance(cause, RayActorError) and not isinstance(cause, ActorUnavailableError)
    ):
        routing_state().unreachable.add(replica)


def unmovable_reason(params: SamplingParams) -> str | None:
    """Why a request's state cannot be resent (None: it can). Everything the engine keeps per
    request today is its sampling parameters and output tokens, which travel; state that lives
    only in one engine (e.g. a grammar's matcher) would be named here."""
    return None


@dataclasses.dataclass
class Migration:
    """One request's moves: how many so far, the replicas it left, and its continuation."""

    limit: int
    moves: int = 0
    step_failures: int = 0  # moves because an engine step raised with this request in it
    left: tuple[str, ...] = ()
    started: float = dataclasses.field(default_factory=time.monotonic)

    def next_move(self, replica: str | None, error: BaseException, params: SamplingParams) -> None:
        """Count a move away from `replica`; raises MigrationFailedError when none is allowed."""
        reason = unmovable_reason(params)
        if isinstance(cause := _cause(error), EngineStepError):
            self.step_failures += 1
            if cause.suspect:
                reason = "the engine step that failed was its first there; it may be the cause, so it does not move"
            elif self.step_failures >= 2:
                reason = "an engine step failed with it on two replicas; it may be the cause, so it does not move again"
        if reason is None and self.moves >= self.limit:
            reason = f"it already moved {self.moves} times (max_migrations={self.limit})"
        if reason is not None:
            raise MigrationFailedError(
                f"the engine replica running this request failed ({error}); {reason}", reason
            ) from error
        self.moves += 1
        if replica is not None and replica not in self.left:
            self.left += (replica,)


def continuation(
    last: RequestOutput | None, child_ids: list[str], params: SamplingParams
) -> tuple[dict[str, list[int]] | None, SamplingParams]:
    """`resume` for the next SubmitRequest, from the last output the caller got (None: nothing
    yet, send it anew), and the parameters to send (prompt logprobs already delivered are not
    computed again)."""
    if last is None:
        return None, params
    resume = {cid: list(c.token_ids) for cid, c in zip(child_ids, last.outputs) if c.finish_reason is None}
    if params.prompt_logprobs is not None and last.prompt_logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=None)
    return resume, params
