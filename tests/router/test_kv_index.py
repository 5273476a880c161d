"""The router's KV index (in-order application, gaps, restarted engines, pending requests) and
the cache-aware ranking's load guard."""

import random

from engine.core.kv_events import BlocksRemoved, BlocksStored, KVEventBatch, KVEventLog, KVSnapshot
from router.replica_choice.cache_aware import rank
from router.replica_choice.kv_index import MAX_EARLY, KVIndex


def batch(epoch, seq, stored=(), removed=()):
    evs = []
    if removed:
        evs.append(BlocksRemoved(tuple(removed)))
    if stored:
        evs.append(BlocksStored(tuple(stored)))
    return KVEventBatch(epoch, seq, tuple(evs))


def test_batches_apply_in_order_whatever_the_arrival_order():
    log = KVEventLog()
    ix = KVIndex()
    ix.reset("r", log.snapshot())
    b1 = log.publish((BlocksStored((1, 2)),))
    b2 = log.publish((BlocksRemoved((1,)), BlocksStored((3,))))
    b3 = log.publish((BlocksStored((1,)),))
    ix.apply("r", [b3])  # early (came on the other path first)
    assert ix.cached_blocks("r", [2]) == 0
    ix.apply("r", [b2, b1, b2])  # out of order and duplicated
    assert ix.position("r") == (log.epoch, 3, False)
    assert ix.replicas["r"].hashes == set(log.snapshot().hashes) == {1, 2, 3}
    assert ix.cached_blocks("r", [1, 2, 9, 3]) == 2


def test_batches_before_the_snapshot_and_a_restarted_engine():
    ix = KVIndex()
    ix.apply("r", [batch("e1", 5, stored=[7])])  # arrives before the first snapshot
    assert ix.position("r")[2]  # needs one
    from engine.core.kv_events import KVSnapshot

    ix.reset("r", KVSnapshot("e1", 4, frozenset({1})))
    assert ix.replicas["r"].hashes == {1, 7} and ix.position("r") == ("e1", 5, False)
    ix.apply("r", [batch("e2", 1, stored=[9])])  # the engine behind "r" restarted
    assert ix.position("r")[2]
    ix.reset("r", KVSnapshot("e2", 0, frozenset()))
    assert ix.replicas["r"].hashes == {9}


def test_a_gap_that_does_not_fill_asks_for_a_snapshot():
    from engine.core.kv_events import KVSnapshot

    ix = KVIndex()
    ix.reset("r", KVSnapshot("e", 0, frozenset()))
    ix.apply("r", [batch("e", s, stored=[s]) for s in range(2, MAX_EARLY + 3)])  # batch 1 lost
    assert ix.position("r")[2] and ix.cached_blocks("r", [2]) == 0


def test_pending_requests_hold_their_blocks_until_they_end():
    ix = KVIndex()
    ix.add_pending("q1", "r", [1, 2, 3])
    assert ix.pending_blocks("r", [1, 2, 4]) == 2 and ix.pending_blocks("s", [1]) == 0
    ix.end_pending("q1")
    assert ix.pending_blocks("r", [1, 2, 4]) == 0
    ix.add_pending("q2", "r", [1])
    ix.drop("r")
    assert ix.pending_blocks("r", [1]) == 0 and "r" not in ix.known()


def test_guard_bounds_the_spread_under_a_hot_prefix():
    """Every request has the same prefix, held (after the first) by replica 0: the guard keeps
    in-flight loads within slack + 1 of each other while requests pile up."""
    rng = random.Random(1)
    for slack in (0.0, 2.0, 4.0):
        inflight = [0, 0, 0]
        for _ in range(200):
            if rng.random() < 0.3:  # some finish
                busy = [i for i in range(3) if inflight[i]]
                if busy:
                    inflight[rng.choice(busy)] -= 1
            order, hits = rank([0, 1, 2], lambda r: inflight[r], lambda r: 10 if r == 0 else 0, slack)
            inflight[order[0]] += 1
            assert max(inflight) - min(inflight) <= slack + 1
        assert hits == {0: 10, 1: 0, 2: 0}


def test_rank_prefers_cached_within_the_guard_and_ties_to_the_less_loaded():
    loads = {"a": 3.0, "b": 0.0, "c": 1.0}
    order, _ = rank(list(loads), loads.get, {"a": 5, "b": 0, "c": 2}.get, slack=4)
    assert order == ["a", "b", "c"]
    order, _ = rank(list(loads), loads.get, {"a": 5, "b": 0, "c": 2}.get, slack=2)
    assert order[0] == "c"  # a is past the guard
    order, _ = rank(list(loads), loads.get, lambda r: 0, slack=4)
    assert order[0] == "b"


def test_a_miss_goes_where_the_fewest_blocks_are_held():
    """Equal hits and loads: the replica holding fewer blocks wins, so sequential new prefixes
    spread over every replica instead of landing by chance (ties are random otherwise)."""
    loads = {"a": 0.0, "b": 0.0, "c": 0.0}
    held = {"a": 0, "b": 0, "c": 0}
    for _ in range(3):
        order, _ = rank(list(loads), loads.get, lambda r: 0, 4.0, held.get)
        held[order[0]] += 12  # the new prefix's blocks are stored there
    assert held == {"a": 12, "b": 12, "c": 12}
    order, _ = rank(list(loads), loads.get, {"a": 0, "b": 3, "c": 0}.get, 4.0, {"a": 0, "b": 90, "c": 5}.get)
    assert order == ["b", "a", "c"]  # a hit still beats free space; the rest by load, then held


def test_held_blocks_count_the_index_and_pending_requests():
    ix = KVIndex()
    ix.reset("r", KVSnapshot(epoch="e", seq=1, hashes=frozenset({1, 2, 3})))
    assert ix.held_blocks("r") == 3 and ix.held_blocks("s") == 0
    ix.add_pending("q", "r", [7, 8])
    ix.add_pending("q2", "s", [9])
    assert ix.held_blocks("r") == 5 and ix.held_blocks("s") == 1
    ix.end_pending("q")
    assert ix.held_blocks("r") == 3


def test_between_equal_hits_a_replica_holding_the_adapter_wins():
    loads = {"a": 0.0, "b": 1.0, "c": 0.0}
    warm = {"b"}.__contains__
    order, _ = rank(list(loads), loads.get, lambda r: 0, 4.0, lambda r: 0, warm)
    assert order[0] == "b"  # its adapter is there: beats a less loaded replica
    order, _ = rank(list(loads), loads.get, {"a": 2, "b": 0, "c": 0}.get, 4.0, lambda r: 0, warm)
    assert order[0] == "a"  # a cached prefix still comes first
    order, _ = rank(list(loads), loads.get, lambda r: 0, 0.5, lambda r: 0, warm)
    assert order[0] != "b"  # and never past the load guard


def test_offload_tier_blocks_are_indexed_apart_from_the_pool():
    """Events of medium "disk" fill the tier's index, not the pool's; a block moves pool -> tier
    on eviction and back on a load; a snapshot carries both; a reset of the prefix cache clears
    every medium."""
    log = KVEventLog()
    ix = KVIndex()
    ix.reset("r", log.snapshot())
    evict = (BlocksRemoved((1, 2)), BlocksStored((1, 2), "disk"))
    ix.apply("r", [log.publish((BlocksStored((1, 2, 3)),)), log.publish(evict)])
    assert ix.cached_blocks("r", [1, 2, 3]) == 0 and ix.cached_blocks("r", [3]) == 1
    assert ix.tier_blocks("r", [1, 2, 3], 0) == 2 and ix.tier_blocks("r", [1, 2, 3], 1) == 1
    load = (BlocksRemoved((1,), "disk"), BlocksStored((1,)))
    ix.apply("r", [log.publish(load)])
    assert ix.cached_blocks("r", [1, 2]) == 1 and ix.tier_blocks("r", [1, 2], 1) == 1
    other = KVIndex()
    other.reset("r", log.snapshot())  # a router that joins later: the same picture
    assert other.replicas["r"].hashes == ix.replicas["r"].hashes == {1, 3}
    assert other.replicas["r"].tiers == ix.replicas["r"].tiers == {"disk": {2}}
    from engine.core.kv_events import AllBlocksCleared

    ix.apply("r", [log.publish((AllBlocksCleared(),))])
    assert ix.replicas["r"].hashes == set() and ix.replicas["r"].tiers == {"disk": set()}


def test_a_longer_tier_hit_beats_a_shorter_pool_hit_and_not_an_equal_one():
    from router.replica_choice.request_router import TIER_WORTH

    pool = {"a": 2, "b": 0, "c": 4}
    tier = {"a": 0, "b": 4, "c": 0}
    worth = {r: pool[r] + TIER_WORTH * tier[r] for r in pool}
    ranked, _ = rank(["a", "b"], lambda r: 0, worth.get)
    assert ranked[0] == "b"  # 4 blocks a load away beat 2 in the pool
    ranked, _ = rank(["b", "c"], lambda r: 0, worth.get)
    assert ranked[0] == "c"  # the same length in the pool wins
