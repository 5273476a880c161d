"""KVCacheManager: prefix hits with exact block ids, sibling sharing, salts, no partial alloc."""

from engine.core.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def req(rid, tokens, salt=None, **sp):
    return Request(rid, list(tokens), SamplingParams(**sp), cache_salt=salt)


def run_prefill(m, r):
    """What the scheduler does for a waiting request given the whole prompt at once."""
    hit, n_hit = m.get_computed_blocks(r)
    new = m.allocate_slots(r, r.num_tokens - n_hit, hit)
    assert new is not None
    m.count_lookup(r, n_hit)
    r.num_computed_tokens = r.num_tokens
    return hit, n_hit, new


def test_allocate_exact_ids_and_growth():
    m = KVCacheManager(BS, 8)
    r = req("a", range(10))
    assert m.allocate_slots(r, 10) == [0, 1, 2]
    r.num_computed_tokens = 10
    assert m.allocate_slots(r, 2) == []  # fits in block 2
    r.num_computed_tokens = 12
    assert m.allocate_slots(r, 1) == [3]
    assert m.get_block_ids("a") == [0, 1, 2, 3]
    m.check_integrity()
    m.free(r)
    # Reverse order: the tail block is the first to be reused.
    assert [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()] == [
        4,
        5,
        6,
        7,
        3,
        2,
        1,
        0,
    ]
    m.check_integrity()


def test_no_partial_allocation_on_failure():
    m = KVCacheManager(BS, 3)
    a = req("a", range(8))
    assert m.allocate_slots(a, 8) == [0, 1]
    b = req("b", range(100, 108))
    assert m.allocate_slots(b, 8) is None
    assert m.block_pool.get_num_free_blocks() == 1 and m.get_block_ids("b") == []
    m.check_integrity()


def test_prefix_hit_exact_blocks_and_ref_counts():
    m = KVCacheManager(BS, 10)
    a = req("a", range(10))  # blocks 0,1 full, 2 partial
    run_prefill(m, a)
    assert m.get_block_ids("a") == [0, 1, 2]
    b = req("b", list(range(8)) + [50, 51, 52])
    hit, n_hit, new = run_prefill(m, b)
    assert [x.block_id for x in hit] == [0, 1] and n_hit == 8
    assert new == [3]
    assert m.get_block_ids("b") == [0, 1, 3]
    blocks = m.block_pool.blocks
    assert [blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert m.block_pool.prefix_cache_queries == 10 + 11
    assert m.block_pool.prefix_cache_hits == 8
    m.check_integrity()
    m.free(a)
    assert [blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    m.check_integrity()


def test_hit_never_covers_last_token():
    m = KVCacheManager(BS, 10)
    a = req("a", range(8))  # exactly two full blocks
    run_prefill(m, a)
    m.free(a)
    b = req("b", range(8))
    hit, n_hit = m.get_computed_blocks(b)
    assert [x.block_id for x in hit] == [0] and n_hit == 4  # last block recomputed


def test_hit_revives_freed_blocks_and_counts_them_against_free():
    m = KVCacheManager(BS, 3)
    a = req("a", range(9))
    run_prefill(m, a)  # blocks 0,1,2
    m.free(a)
    b = req("b", range(9))
    hit, n_hit = m.get_computed_blocks(b)
    assert [x.block_id for x in hit] == [0, 1] and n_hit == 8
    # 3 free blocks, two of which are the hits: one fresh block is left and needed.
    assert m.allocate_slots(b, 1, hit) == [2]
    assert m.block_pool.get_num_free_blocks() == 0
    m.check_integrity()
    c = req("c", range(9))
    hit, _ = m.get_computed_blocks(c)
    assert m.allocate_slots(c, 1, hit) is None  # needs one more block, none free
    assert [m.block_pool.blocks[i].ref_cnt for i in range(3)] == [1, 1, 1]
    m.check_integrity()


def test_free_hit_blocks_are_not_counted_twice():
    m = KVCacheManager(BS, 3)
    a = req("a", range(9))
    run_prefill(m, a)
    m.free(a)  # all 3 blocks free, 0 and 1 still cached
    b = req("b", range(13))
    hit, n_hit = m.get_computed_blocks(b)
    assert [x.block_id for x in hit] == [0, 1]
    # 2 hits + 2 fresh blocks > 3 blocks: refused without touching anything.
    assert m.allocate_slots(b, 13 - n_hit, hit) is None
    assert m.block_pool.get_num_free_blocks() == 3 and m.block_pool.get_num_cached_blocks() == 2
    m.check_integrity()


def test_siblings_share_with_caching_off_same_salt_only():
    m = KVCacheManager(BS, 20, enable_prefix_caching=False)
    s1 = req("s1", range(9), salt="req-7")
    run_prefill(m, s1)
    s2 = req("s2", range(9), salt="req-7")
    hit, n_hit, new = run_prefill(m, s2)
    assert [x.block_id for x in hit] == [0, 1] and n_hit == 8 and new == [3]
    # Other salt and no salt: no sharing.
    other = req("o", range(9), salt="req-8")
    assert m.get_computed_blocks(other) == ([], 0)
    plain = req("p", range(9))
    run_prefill(m, plain)
    plain2 = req("p2", range(9))
    assert m.get_computed_blocks(plain2) == ([], 0)
    # Unsalted requests never publish blocks when caching is off.
    assert all(m.block_pool.blocks[i].block_hash is None for i in m.get_block_ids("p"))
    m.check_integrity()


def test_no_sharing_across_salts_with_caching_on():
    m = KVCacheManager(BS, 20)
    run_prefill(m, req("a", range(9), salt="x"))
    assert m.get_computed_blocks(req("b", range(9), salt="y")) == ([], 0)
    assert m.get_computed_blocks(req("c", range(9))) == ([], 0)
    hit, n = m.get_computed_blocks(req("d", range(9), salt="x"))
    assert [x.block_id for x in hit] == [0, 1] and n == 8


def test_decode_completed_block_is_cached():
    m = KVCacheManager(BS, 10)
    a = req("a", range(6))
    run_prefill(m, a)  # one full block cached
    assert m.block_pool.get_num_cached_blocks() == 1
    for tok in (100, 101):  # sampled tokens; the second step completes block 1
        a.append_output_token_ids([tok])
        assert m.allocate_slots(a, 1) == []
        a.num_computed_tokens += 1
    assert m.block_pool.get_num_cached_blocks() == 2
    b = req("b", list(range(6)) + [100, 101, 7])
    hit, n = m.get_computed_blocks(b)
    assert [x.block_id for x in hit] == [0, 1] and n == 8


def test_prompt_logprobs_skip_lookup():
    m = KVCacheManager(BS, 10)
    run_prefill(m, req("a", range(9)))
    assert m.get_computed_blocks(req("b", range(9), prompt_logprobs=1)) == ([], 0)


def test_usage_and_waste_stats():
    m = KVCacheManager(BS, 8)
    a = req("a", range(5))
    run_prefill(m, a)  # 2 blocks, 5 tokens stored in 8 slots
    assert m.usage() == 2 / 8
    assert m.kv_waste([a]) == 3 / 8
    s = m.stats([a])
    assert s["blocks_used"] == 2 and s["blocks_free"] == 6 and s["blocks_cached"] == 1
    assert s["kv_waste"] == 3 / 8 and s["prefix_hit_rate"] == 0.0
