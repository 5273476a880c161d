"""The ingress's failover decisions, without Ray processes: which errors move a request, the
continuation built from the last output, and the move limit (then a clear 503)."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError

from engine.errors import EngineDeadError, EngineStepError, InvalidRequestError
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from router.backpressure import OverloadedError
from router.ingress.errors import to_api_error
from router.ingress.failover import (
    Migration,
    MigrationFailedError,
    ReplicaDrainingError,
    ReplicaLostError,
    continuation,
    moves_request,
)
from router.replica_choice.request_router import ReplicaGoneError


def test_replica_failures_move_request_errors_do_not():
    for e in (ReplicaLostError("x"), ReplicaDrainingError("x"), EngineDeadError("x"), ReplicaGoneError("x")):
        assert moves_request(e)
    assert moves_request(ActorDiedError())
    for e in (InvalidRequestError("bad"), OverloadedError("busy", 1), ValueError("x")):
        assert not moves_request(e)


def test_continuation_resumes_unfinished_children_with_their_outputs():
    params = SamplingParams(n=2, seed=5, max_tokens=8, prompt_logprobs=1)
    assert continuation(None, ["r#0", "r#1"], params) == (None, params)  # nothing yet: sent anew
    last = RequestOutput(
        "r",
        None,
        [1, 2],
        [CompletionOutput(0, "ab", [7, 8], None, "length"), CompletionOutput(1, "c", [9], None, None)],
        prompt_logprobs=[None, None],
    )
    resume, sent = continuation(last, ["r#0", "r#1"], params)
    assert resume == {"r#1": [9]}  # the finished child stays finished
    assert sent.prompt_logprobs is None and sent.seed == 5 and sent.n == 2  # delivered once only


def test_move_limit_then_a_clear_503():
    m = Migration(limit=2)
    params = SamplingParams()
    m.next_move("a", ReplicaLostError("gone"), params)
    m.next_move(None, ReplicaLostError("gone"), params)  # a failed submit: replica unknown
    assert m.moves == 2 and m.left == ("a",)
    with pytest.raises(MigrationFailedError, match="max_migrations=2") as e:
        m.next_move("b", ReplicaLostError("gone"), params)
    err = to_api_error(e.value)
    assert err.status == 503 and "max_migrations" in err.message


def test_a_request_in_two_failed_engine_steps_stops_moving():
    """Poison pill: a request present when a step raised on two replicas fails instead of taking
    down a third; process losses do not count towards it."""
    m = Migration(limit=3)
    params = SamplingParams()
    m.next_move("a", EngineStepError("engine step failed: RuntimeError: boom"), params)
    m.next_move("b", ReplicaLostError("gone"), params)
    with pytest.raises(MigrationFailedError, match="may be the cause"):
        m.next_move("c", EngineStepError("engine step failed: RuntimeError: boom"), params)
    assert m.moves == 2
