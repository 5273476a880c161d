"""The offload tier's scheduler half, with exact block ids and counts: evicted cached blocks are
saved by hash before their new owner writes them, a prefix lookup continues into the tier, hits
are loaded into fresh blocks and published, failed loads recompute, the LRU drops the oldest,
and every block returns to the pool. The runner stand-in copies nothing (engine tests do)."""

from __future__ import annotations

from engine.config import CacheConfig, SchedulerConfig
from engine.core.block_hash import prompt_hit_hashes
from engine.core.kv_events import BlocksRemoved, BlocksStored, KVEventLog
from engine.core.scheduler import Scheduler
from engine.kv_transfer.config import KVTransferConfig
from tests.engine.test_scheduler import BS, fake_runner, make_req

A = list(range(100, 113))  # 13 tokens: 3 full blocks may hit (the last token is recomputed)


def make(num_blocks=8, slots=16, budget=64, **kw) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256),
        CacheConfig(block_size=BS),
        num_blocks,
        offload_slots=slots,
        **kw,
    )


def run(sched, fail=lambda so: []):
    """Steps to the end; returns every scheduler output."""
    outs = []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            return outs
        so = sched.schedule()
        sched.check_integrity()
        mro = fake_runner(sched, so)
        mro.kv_load_failed = fail(so)
        sched.update_from_output(so, mro)
        sched.check_integrity()
        outs.append(so)
    raise AssertionError("did not finish")


def evict_all(sched, tag: str, n: int = 2, length: int = 32) -> list:
    """Other traffic that takes every block of the pool, one request at a time."""
    outs = []
    for i in range(n):
        base = 1000 * (len(tag) + 1) + 40 * i
        sched.add_request(make_req(f"{tag}{i}", range(base, base + length), max_tokens=1))
        outs += run(sched)
    return outs


def test_evicted_blocks_are_saved_then_loaded_back_as_a_prefix_hit():
    sched = make()
    kv = sched.kv_cache_manager
    sched.add_request(make_req("a", A, max_tokens=2))
    run(sched)
    a_hashes = prompt_hit_hashes(A, BS)
    assert len(a_hashes) == 3
    saves = [s for so in evict_all(sched, "x") for s in so.kv_saves]
    # A's three cached blocks (and its 4th, completed by an output token) left the pool by hash.
    saved = {h for _, _, h in saves}
    assert set(a_hashes) <= saved
    for so_saves in [saves]:
        assert len({slot for _, slot, _ in so_saves}) == len(so_saves)  # one slot each
    # A again: the pool has none of it, the tier all three blocks.
    r = make_req("a2", A, max_tokens=2)
    sched.add_request(r)
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == 0 and len(so.kv_loads) == 3
    assert [h for _, _, h in so.kv_loads] == a_hashes
    assert [b for _, b, _ in so.kv_loads] == kv.get_block_ids("a2")
    slots = {h: slot for _, slot, h in saves}
    assert [s for s, _, _ in so.kv_loads] == [slots[h] for h in a_hashes]
    sched.check_integrity()
    sched.update_from_output(so, fake_runner(sched, so))
    sched.check_integrity()
    # Loaded: published in the pool, the request goes on from token 12 as a prefix hit.
    assert all(kv.block_pool.get_cached_block(h) is not None for h in a_hashes)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a2": 1} and so.new_requests[0].num_computed_tokens == 12
    sched.update_from_output(so, fake_runner(sched, so))
    run(sched)
    st = sched.stats()
    assert st["prefix_cache_hits_offload"] == 12 and st["offload_blocks_loaded"] == 3
    assert r.num_cached_tokens == 12 and st["offload_load_failures"] == 0
    assert st["blocks_used"] == 0


def test_a_save_precedes_the_block_s_reuse_in_the_same_step():
    """The block a save reads is the one the step's new owner gets: the runner copies first."""
    sched = make(num_blocks=4)
    sched.add_request(make_req("a", A, max_tokens=1))
    run(sched)
    sched.add_request(make_req("b", range(300, 313), max_tokens=1))
    so = sched.schedule()
    owned = set(sched.kv_cache_manager.get_block_ids("b"))
    assert so.kv_saves and {b for b, _, _ in so.kv_saves} <= owned


def test_failed_load_is_recomputed_from_the_failed_block_on():
    sched = make()
    sched.add_request(make_req("a", A, max_tokens=1))
    run(sched)
    evict_all(sched, "x")
    sched.add_request(make_req("a2", A, max_tokens=1))
    outs = run(sched, fail=lambda so: [1] if so.kv_loads else [])
    first_compute = next(so for so in outs if so.total_num_scheduled_tokens)
    # Block 0 loaded; block 1 failed, so blocks 1, 2 and the last token are computed.
    assert first_compute.new_requests[0].num_computed_tokens == BS
    assert first_compute.num_scheduled_tokens == {"a2": 13 - BS}
    st = sched.stats()
    assert st["offload_load_failures"] == 1 and st["prefix_cache_hits_offload"] == BS
    h1 = prompt_hit_hashes(A, BS)[1]
    assert h1 not in sched.kv_cache_manager.offload.index  # dropped from the tier
    assert st["blocks_used"] == 0


def test_lru_drops_the_oldest_and_a_dropped_hash_is_recomputed():
    sched = make(num_blocks=4, slots=3)
    log = KVEventLog()
    sched.add_request(make_req("a", A, max_tokens=1))
    run(sched)
    a_hashes = prompt_hit_hashes(A, BS)
    sched.add_request(make_req("b", range(300, 313), max_tokens=1))
    run(sched)  # A's 3 blocks go to the tier (3 slots): full
    index = sched.kv_cache_manager.offload.index
    assert [h in index for h in a_hashes] == [True, True, True]
    sched.add_request(make_req("c", range(600, 613), max_tokens=1))
    run(sched)  # B's 3 blocks evict A's from the tier, oldest first
    assert not any(h in index for h in a_hashes) and len(index) == 3
    assert sched.stats()["offload_blocks_dropped"] == 3
    events = log.publish(sched.kv_cache_manager.block_pool.events.take()).events
    disk_removed = [h for e in events if type(e) is BlocksRemoved and e.medium == "disk" for h in e.hashes]
    disk_stored = [h for e in events if type(e) is BlocksStored and e.medium == "disk" for h in e.hashes]
    # A request's blocks are freed tail first, so saved and then dropped tail first.
    assert disk_removed[:3] == a_hashes[::-1] and set(a_hashes) <= set(disk_stored)
    assert log.snapshot().tiers["disk"] == frozenset(index._lru)
    assert not log.snapshot().hashes & log.snapshot().tiers["disk"]
    sched.add_request(make_req("a2", A, max_tokens=1))
    outs = run(sched)
    assert not any(so.kv_loads for so in outs)
    assert outs[0].num_scheduled_tokens == {"a2": 13}  # recomputed whole


def test_prompt_logprobs_and_caching_off_skip_the_tier():
    sched = make()
    sched.add_request(make_req("a", A, max_tokens=1))
    run(sched)
    evict_all(sched, "x")
    sched.add_request(make_req("p", A, max_tokens=1, prompt_logprobs=1))
    outs = run(sched, fail=lambda so: [])
    assert not any(so.kv_loads for so in outs) and outs[0].num_scheduled_tokens == {"p": 13}


def test_abort_while_loading_frees_every_block():
    sched = make()
    sched.add_request(make_req("a", A, max_tokens=1))
    run(sched)
    evict_all(sched, "x")
    sched.add_request(make_req("a2", A, max_tokens=4))
    so = sched.schedule()
    assert so.kv_loads
    sched.abort_requests("a2")
    sched.update_from_output(so, fake_runner(sched, so))
    sched.check_integrity()
    assert sched.stats()["blocks_used"] == 0 and not sched.has_unfinished_requests()


def test_decode_role_loads_a_short_suffix_and_asks_the_prefill_pool_for_a_long_one():
    """Disaggregated decode: the tier's hits count as cached when deciding whether to prefill
    here; a long uncached suffix still goes to a prefill engine."""
    sched = make(kv_transfer=KVTransferConfig("decode", local_prefill_max_tokens=16))
    sched.add_request(make_req("a", A, max_tokens=1))
    run(sched)  # 12 tokens to compute <= 16: prefilled here
    evict_all(sched, "x", n=4, length=13)
    sched.add_request(make_req("a2", A, max_tokens=1))
    outs = run(sched)
    assert len(outs[0].kv_loads) == 3 and sched.stats()["num_remote_prefills"] == 0
    longer = A[:12] + list(range(700, 720))  # 3 pool hits, then 19 tokens > 16
    sched.add_request(make_req("l", longer, max_tokens=1))
    so = sched.schedule()
    assert not so.kv_loads and sched.stats()["num_remote_prefills"] == 1
    sched.update_from_output(so, fake_runner(sched, so))
    sched.remote_kv_done("l", loaded=False)  # recomputed here
    run(sched)
    assert sched.stats()["blocks_used"] == 0


def test_events_describe_the_pool_and_the_tier_apart_under_random_traffic():
    """A reader of pool hits (apply_events' default medium) still sees exactly the pool's hash
    map with the tier on; the tier's own events describe exactly its index."""
    import random

    from engine.core.kv_events import apply_events

    rng = random.Random(1)
    sched = make(num_blocks=12, slots=10)
    log, pool_reader, tier_reader = KVEventLog(), set(), set()
    prefixes = [[rng.randrange(1000) for _ in range(8)] for _ in range(4)]
    loads = 0
    for i in range(40):
        sched.add_request(
            make_req(f"r{i}", rng.choice(prefixes) + [rng.randrange(1000) for _ in range(5)], max_tokens=2)
        )
        loads += sum(len(so.kv_loads) for so in run(sched))
        batch = log.publish(sched.kv_cache_manager.block_pool.events.take())
        if batch is not None:
            apply_events(pool_reader, batch.events)
            apply_events(tier_reader, batch.events, "disk")
        assert pool_reader == set(sched.kv_cache_manager.block_pool.cached_block_hash_to_block)
        assert tier_reader == set(sched.kv_cache_manager.offload.index._lru) == log.snapshot().tiers.get("disk", set())
    assert loads > 0 and sched.stats()["blocks_used"] == 0
