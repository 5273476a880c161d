"""The replica choice's plan to fetch a prompt's prefix from a peer, without Ray: the cost model
(router/replica_choice/peer_fetch_plan.py) and the hint the cache-aware router puts on the
`submit` message when the load guard passes over the replica holding the prefix."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

import router.replica_choice.routing_state as routing_state_module
from engine.core.block_hash import prompt_hit_hashes
from engine.core.kv_events import KVSnapshot
from engine.kv_transfer.peer_prefix import PeerPrefix
from engine.sampling_params import SamplingParams
from router.messages import SubmitRequest
from router.replica_choice.peer_fetch_plan import (
    DEFAULT_FETCH_LATENCY_S,
    DEFAULT_PREFILL_TOKENS_PER_S,
    estimates,
    should_fetch,
)
from router.replica_choice.request_router import EngineRequestRouter
from router.replica_choice.routing_state import RoutingState

BS = 16
BLOCK = {"kv_bytes_per_block": 1 << 20}  # 1 MiB a block (a mid-size model)


def test_cost_model_uses_measurements_and_defaults():
    fetch_s, recompute_s = estimates(10, BS, BLOCK)
    assert fetch_s == pytest.approx(DEFAULT_FETCH_LATENCY_S + 10 * (1 << 20) / 1e9)
    assert recompute_s == pytest.approx(10 * BS / DEFAULT_PREFILL_TOKENS_PER_S)
    assert should_fetch("auto", 10, BS, BLOCK)
    # A fast prefill and a slow transfer: recomputing wins.
    slow_link = {**BLOCK, "kv_fetch_bytes_per_s": 1e7, "kv_fetch_latency_s": 0.05, "prefill_tokens_per_s": 5e4}
    assert not should_fetch("auto", 10, BS, slow_link)
    assert should_fetch("always", 10, BS, slow_link)
    # A measured latency of 0 is a measurement, not a missing figure.
    assert estimates(2, BS, {**BLOCK, "kv_fetch_latency_s": 0.0})[0] == pytest.approx(2 * (1 << 20) / 1e9)


def test_no_fetch_when_off_too_small_or_unknown_block_size():
    assert not should_fetch("off", 10, BS, BLOCK)
    assert not should_fetch("always", 1, BS, BLOCK)  # below MIN_EXTRA_BLOCKS
    assert not should_fetch("always", 10, BS, {})  # an older replica: block size unknown
    assert estimates(10, BS, {}) is None


class FakeReplica:
    """What the router reads of Serve's RunningReplica (hashable: the ranking keys dicts by it)."""

    def __init__(self, rid: str, **stats) -> None:
        self.replica_id = SimpleNamespace(unique_id=rid)
        self.routing_stats = {**BLOCK, **stats}


_replica = FakeReplica


@pytest.fixture
def router(monkeypatch):
    state = RoutingState()
    monkeypatch.setattr(routing_state_module, "_PROCESS_STATE", state)
    r = object.__new__(EngineRequestRouter)
    r.initialize_state(policy="cache-aware", block_size=BS, slack=1.0, peer_fetch="auto")
    r.loads = {}
    monkeypatch.setattr(r, "load", lambda rep: r.loads[rep.replica_id.unique_id])
    return r, state


PROMPT = list(range(1, 8 * BS + 5))  # 8 full blocks that may hit


def _submit(prompt=PROMPT) -> SubmitRequest:
    return SubmitRequest("req-1", list(prompt), SamplingParams(max_tokens=4), "ingress", 0.0)


def _hold(state: RoutingState, rid: str, blocks: int) -> None:
    hashes = prompt_hit_hashes(PROMPT, BS)[:blocks]
    state.kv_index.reset(rid, KVSnapshot("e", 0, frozenset(hashes)))


def test_a_guarded_holder_becomes_the_chosen_replica_s_source(router):
    r, state = router
    a, b, c = _replica("A"), _replica("B"), _replica("C")
    _hold(state, "A", 8)
    _hold(state, "B", 2)
    r.loads = {"A": 5.0, "B": 1.0, "C": 1.0}  # A is past the guard (slack 1)
    ranked, _, predicted, peer = r._cache_aware([a, b, c], _submit())
    assert ranked[0] is b
    assert peer == PeerPrefix("A", 8 * BS)
    assert predicted["B"] == 8 * BS  # the fetched tokens count as cached there

    # Within the guard the holder itself is chosen: nothing to fetch.
    r.loads = {"A": 1.0, "B": 1.0, "C": 1.0}
    ranked, _, _, peer = r._cache_aware([a, b, c], _submit())
    assert ranked[0] is a and peer is None


def test_no_hint_when_the_gain_is_small_the_setting_is_off_or_recompute_is_cheaper(router):
    r, state = router
    a, b = _replica("A"), _replica("B")
    r.loads = {"A": 5.0, "B": 0.0}
    _hold(state, "A", 3)
    _hold(state, "B", 2)  # 1 block more on A: below the minimum
    assert r._cache_aware([a, b], _submit())[3] is None
    _hold(state, "B", 0)
    assert r._cache_aware([a, b], _submit())[3] == PeerPrefix("A", 3 * BS)
    fast = _replica("B", prefill_tokens_per_s=1e6, kv_fetch_latency_s=0.05)
    assert r._cache_aware([a, fast], _submit())[3] is None
    r.peer_fetch = "off"
    assert r._cache_aware([a, b], _submit())[3] is None


def test_only_blocks_the_holder_reported_count(router):
    """Blocks pending on a replica (a request routed there, not computed yet) are no source."""
    r, state = router
    a, b = _replica("A"), _replica("B")
    r.loads = {"A": 5.0, "B": 0.0}
    state.kv_index.add_pending("other", "A", prompt_hit_hashes(PROMPT, BS))
    assert r._cache_aware([a, b], _submit())[3] is None


def test_choose_replicas_puts_the_hint_on_the_message_and_the_log_records_it(router):
    r, state = router
    a, b = _replica("A"), _replica("B")
    r.replicas = [a, b]
    r.loads = {"A": 5.0, "B": 0.0}
    _hold(state, "A", 8)
    msg = _submit()
    pending = SimpleNamespace(args=[msg], kwargs={}, metadata=SimpleNamespace(call_method="submit"))
    ranked = asyncio.run(r.choose_replicas([a, b], pending))
    assert ranked[0] == [b]
    sent = pending.args[0]
    assert sent.peer_prefix == PeerPrefix("A", 8 * BS) and dataclasses.replace(sent, peer_prefix=None) == msg
    state.confirmed("req-1", "B")
    d = state.log.recent()["req-1"]
    assert (d["peer_source"], d["peer_tokens"], d["predicted_cached_tokens"]) == ("A", 8 * BS, 8 * BS)
    assert state.log.stats()["per_replica"]["B"]["peer_fetches_planned"] == 1
    # Routed again (the replica refused it) where no fetch is planned: the hint is cleared.
    state.ended("req-1")
    r.loads = {"A": 0.0, "B": 0.0}
    asyncio.run(r.choose_replicas([a, b], pending))
    assert pending.args[0].peer_prefix is None
