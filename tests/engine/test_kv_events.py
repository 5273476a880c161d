"""KV events: the published stream always describes exactly the pool's hash map, and a reader's
prediction of a prompt's prefix hit equals what the scheduler then finds."""

import random

from engine.core.block_hash import prompt_hit_hashes
from engine.core.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEventLog, apply_events
from tests.engine.test_scheduler import BS, make_req, make_sched, step


def held(sched) -> set[int]:
    return set(sched.kv_cache_manager.block_pool.cached_block_hash_to_block)


def publish(sched, log: KVEventLog):
    return log.publish(sched.kv_cache_manager.block_pool.events.take())


def predicted_hit(reader: set[int], prompt: list[int]) -> int:
    n = 0
    for h in prompt_hit_hashes(prompt, BS):
        if h not in reader:
            break
        n += 1
    return n * BS


def test_stream_mirrors_pool_under_evictions_and_predicts_hits_exactly():
    rng = random.Random(0)
    sched = make_sched(num_blocks=24, budget=64, max_seqs=4)
    log, reader, seq = KVEventLog(capacity=8), set(), 0
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([8, 12, 16]))] for _ in range(4)]
    checked = evictions = 0
    for i in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
        sequential = not sched.has_unfinished_requests()
        expect = predicted_hit(reader, prompt)
        r = make_req(f"r{i}", prompt, max_tokens=rng.randrange(1, 6))
        sched.add_request(r)
        for _ in range(rng.randrange(1, 4)):
            if not sched.has_unfinished_requests():
                break
            step(sched)
            batch = publish(sched, log)
            if batch is not None:
                seq += 1
                assert batch.seq == seq and batch.epoch == log.epoch
                apply_events(reader, batch.events)
            assert reader == held(sched) == set(log.snapshot().hashes)
        if sequential and r.num_cached_tokens >= 0:
            # Scheduled alone: the prediction of whole blocks is exact (a tail hit adds < BS).
            assert r.num_cached_tokens - r.num_cached_tokens % BS == expect, i
            checked += 1
    evictions = sched.kv_cache_manager.block_pool.num_evictions
    assert checked >= 10 and evictions > 0 and seq > 8  # the ring (capacity 8) was overrun


def test_since_and_snapshot():
    log = KVEventLog(capacity=2)
    assert log.since(log.epoch, 0) == []
    for h in (1, 2, 3):
        log.publish((BlocksStored((h,)),))
    assert [b.seq for b in log.since(log.epoch, 1)] == [2, 3]
    assert log.since(log.epoch, 0) is None  # batch 1 was dropped: snapshot needed
    assert log.since("other", 3) is None  # another engine: snapshot needed
    assert log.since(log.epoch, 4) is None
    log.publish((BlocksRemoved((2,)),))
    snap = log.snapshot()
    assert (snap.seq, snap.hashes) == (4, frozenset({1, 3}))
    log.publish((AllBlocksCleared(), BlocksStored((9,))))
    assert log.snapshot().hashes == frozenset({9})
    assert log.publish(()) is None and log.seq == 5


def test_reset_prefix_cache_publishes_cleared():
    sched = make_sched()
    log = KVEventLog()
    sched.add_request(make_req("a", range(12), max_tokens=1))
    step(sched)
    publish(sched, log)
    assert log.snapshot().hashes
    sched.reset_prefix_cache()
    batch = publish(sched, log)
    assert batch.events == (AllBlocksCleared(),) and not log.snapshot().hashes
