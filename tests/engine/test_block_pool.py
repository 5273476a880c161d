"""FreeBlockQueue, block hashes and BlockPool: exact ids, LRU order, eviction only on reuse."""

import pytest

from engine.core.block_hash import hash_block_tokens, update_block_hashes
from engine.core.block_pool import BlockPool
from engine.core.free_block_queue import FreeBlockQueue, KVCacheBlock
from engine.request import Request
from engine.sampling_params import SamplingParams


def ids(blocks):
    return [b.block_id for b in blocks]


def make_request(rid, tokens, salt=None):
    return Request(rid, list(tokens), SamplingParams(), cache_salt=salt)


# --- FreeBlockQueue ---------------------------------------------------------------------------


def test_queue_popleft_remove_append_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    assert q.popleft().block_id == 0
    q.remove(blocks[2])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4]
    assert q.num_free_blocks == 3
    q.append(blocks[2])
    q.append_n([blocks[0]])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 2, 0]
    q.remove(blocks[0])  # tail
    q.remove(blocks[1])  # head
    assert ids(q.get_all_free_blocks()) == [3, 4, 2]
    assert len(q) == 3


def test_queue_errors():
    b = KVCacheBlock(0)
    q = FreeBlockQueue([b])
    with pytest.raises(ValueError):
        q.append(b)  # already queued
    q.popleft()
    with pytest.raises(ValueError):
        q.popleft()  # empty
    with pytest.raises(ValueError):
        q.remove(b)  # not queued


# --- block hashes -----------------------------------------------------------------------------


def test_hash_chain_depends_on_parent_tokens_and_salt():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, (1, 2, 3, 4))  # stable, type-independent
    assert h0.bit_length() > 128  # full digest, not a truncated 64-bit hash
    assert h0 != hash_block_tokens(None, [1, 2, 3, 5])
    assert h0 != hash_block_tokens(None, [1, 2, 3, 4], ("salt", "a"))
    assert hash_block_tokens(h0, [5, 6]) != hash_block_tokens(None, [5, 6])
    # Unambiguous encoding: moving a token across the extra-key boundary changes the hash.
    assert hash_block_tokens(None, [1, 2], (3,)) != hash_block_tokens(None, [1, 2, 3])


def test_update_block_hashes_incremental_full_blocks_only():
    req = make_request("a", range(10))
    assert len(update_block_hashes(req, 4)) == 2  # 10 tokens -> 2 full blocks
    first = list(req.block_hashes)
    req.append_output_token_ids([10, 11])
    update_block_hashes(req, 4)
    assert req.block_hashes[:2] == first and len(req.block_hashes) == 3
    assert req.block_hashes[2] == hash_block_tokens(first[1], [8, 9, 10, 11])
    salted = make_request("b", range(10), salt="s")
    update_block_hashes(salted, 4)
    assert salted.block_hashes[0] != first[0] and salted.block_hashes[1] != first[1]


# --- BlockPool --------------------------------------------------------------------------------


def test_alloc_free_order_and_counts():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    assert ids(a) == [0, 1, 2] and all(b.ref_cnt == 1 for b in a)
    assert pool.get_num_free_blocks() == 3 and pool.get_num_used_blocks() == 3
    pool.free_blocks(reversed(a))  # tail block first
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 5, 2, 1, 0]
    assert ids(pool.get_new_blocks(4)) == [3, 4, 5, 2]
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)


def test_eviction_only_on_reuse_and_tail_first():
    pool = BlockPool(4)
    req = make_request("r", range(12))
    update_block_hashes(req, 4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 3)
    assert pool.get_num_cached_blocks() == 3
    pool.free_blocks(reversed(blocks))
    # Freed but still cached: a lookup revives them.
    assert pool.get_num_cached_blocks() == 3 and pool.num_evictions == 0
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 2, 1, 0]
    pool.check_integrity()
    # Reuse pops the uncached block 3 first, then the request's tail block 2, then 1.
    got = pool.get_new_blocks(2)
    assert ids(got) == [3, 2]
    assert pool.num_evictions == 1 and got[1].block_hash is None
    assert pool.get_cached_block(req.block_hashes[2]) is None
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.get_cached_block(req.block_hashes[1]) is None
    assert pool.get_num_cached_blocks() == 1
    pool.check_integrity()


def test_touch_revives_free_cached_block_and_shares_in_use():
    pool = BlockPool(3)
    req = make_request("r", range(4))
    update_block_hashes(req, 4)
    (b0,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [b0], 0, 1)
    pool.touch([b0])  # shared while in use
    assert b0.ref_cnt == 2 and pool.get_num_free_blocks() == 2
    pool.free_blocks([b0])
    pool.free_blocks([b0])
    assert b0.ref_cnt == 0 and ids(pool.free_block_queue.get_all_free_blocks()) == [1, 2, 0]
    pool.touch([b0])  # hit on a free cached block: leaves the free queue
    assert b0.ref_cnt == 1 and ids(pool.free_block_queue.get_all_free_blocks()) == [1, 2]
    assert b0.block_hash == req.block_hashes[0]
    pool.check_integrity()


def test_duplicate_hash_blocks_and_reset():
    pool = BlockPool(4)
    r1, r2 = make_request("1", range(4)), make_request("2", range(4))
    update_block_hashes(r1, 4)
    update_block_hashes(r2, 4)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_blocks(r1, [b1], 0, 1)
    pool.cache_full_blocks(r2, [b2], 0, 1)
    assert pool.get_num_cached_blocks() == 2
    pool.free_blocks([b1])
    pool.get_new_blocks(3)  # evicts b1 only; the hash still maps to b2
    assert pool.get_cached_block(r1.block_hashes[0]) is b2
    pool.check_integrity()
    pool.record_prefix_query(10, 4)
    assert pool.prefix_hit_rate == 0.4
    pool.reset_prefix_cache()
    assert pool.get_num_cached_blocks() == 0 and b2.block_hash is None
    assert pool.prefix_cache_queries == 0
    pool.check_integrity()


def test_integrity_detects_leak():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    b.ref_cnt = 0  # leaked: not free, not in use
    with pytest.raises(AssertionError):
        pool.check_integrity()
