"""Token-granular prefix hits (engine/core/tail_hits.py): which block a lookup copies from and how
many slots, the copy list and the held source, salts, eviction; then through the engine, the
same tokens and logprobs as without prefix caching while reusing down to the token."""

import pytest

from engine import LLM, SamplingParams
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.tail_hits import MAX_CANDIDATES
from engine.request import Request

BS = 4


def req(rid, tokens, salt=None, **sp):
    return Request(rid, list(tokens), SamplingParams(**sp), cache_salt=salt)


def schedule(m, r):
    """What the scheduler does for a waiting request: full-block hits, then a tail hit."""
    m.begin_step()
    hit, n_hit = m.get_computed_blocks(r)
    tail = m.find_tail(r, len(hit))
    n_tail = tail.num_tokens if tail is not None else 0
    new = m.allocate_slots(r, r.num_tokens - n_hit - n_tail, hit, tail=tail)
    assert new is not None
    m.count_lookup(r, n_hit)  # the admission's full-block hits (allocate_slots counts the tail's)
    r.num_computed_tokens = r.num_tokens
    return n_hit + n_tail, m.take_copies(), new


def test_a_full_block_with_another_continuation_lends_its_shared_slots():
    m = KVCacheManager(BS, 16)
    a = req("a", range(10))  # blocks 0, 1 full ([0..3], [4..7])
    schedule(m, a)
    b = req("b", [0, 1, 2, 3, 4, 5, 50, 51, 52])
    cached, copies, new = schedule(m, b)
    assert cached == 6  # block 0 whole, then [4, 5] of a's block 1
    assert copies == [(1, new[0], 2)]
    assert m.get_block_ids("b") == [0] + new
    assert m.block_pool.blocks[1].ref_cnt == 2  # a's, and held until the step has run
    m.check_integrity()
    m.release_copy_sources()
    assert m.block_pool.blocks[1].ref_cnt == 1
    m.check_integrity()


def test_a_freed_requests_partial_block_serves_the_next_turn():
    m = KVCacheManager(BS, 16)
    a = req("a", range(10))
    schedule(m, a)
    a.append_output_token_ids([70])
    a.append_output_token_ids([71])
    a.num_computed_tokens = 11  # the last sampled token has no KV
    m.free(a)  # block 2 holds [8, 9, 70] in 3 slots
    b = req("b", [*range(10), 70, 71, 90, 91])
    cached, copies, new = schedule(m, b)
    assert cached == 11 and copies == [(2, new[0], 3)]
    assert m.block_pool.blocks[2].ref_cnt == 1  # a free block, held for the copy
    m.release_copy_sources()
    m.check_integrity()


def test_a_repeated_prompt_recomputes_only_its_last_token():
    m = KVCacheManager(BS, 16)
    schedule(m, req("a", range(8)))  # two full blocks
    b = req("b", range(8))
    cached, copies, _ = schedule(m, b)
    assert cached == 7  # block 0 by hash, 3 slots of block 1 copied
    assert copies[0][0] == 1 and copies[0][2] == 3
    assert m.block_pool.prefix_cache_hits == 7


def test_blocks_published_in_the_same_schedule_are_not_copied():
    """Their KV is written by the very forward the copies precede."""
    m = KVCacheManager(BS, 16)
    a = req("a", range(8))
    m.begin_step()
    hit, n = m.get_computed_blocks(a)
    assert m.allocate_slots(a, 8, hit) is not None
    a.num_computed_tokens = 8
    b = req("b", [0, 1, 2, 3, 4, 5, 99])
    hit, n = m.get_computed_blocks(b)  # block 0: a hit (the forward writes it before reading)
    assert n == 4 and m.find_tail(b, len(hit)) is None
    m.begin_step()  # the next step: a's blocks hold their KV
    assert m.find_tail(b, len(hit)).num_tokens == 2


def test_salts_and_caching_off_isolate_tails():
    m = KVCacheManager(BS, 16)
    schedule(m, req("a", range(10), salt="x"))
    assert schedule(m, req("b", range(6), salt="y"))[0] == 0
    assert schedule(m, req("c", range(6), salt="x"))[0] == 5
    off = KVCacheManager(BS, 16, enable_prefix_caching=False)
    schedule(off, req("a", range(10)))
    assert schedule(off, req("b", range(6)))[0] == 0


def test_prompt_logprobs_take_no_tail():
    m = KVCacheManager(BS, 16)
    schedule(m, req("a", range(8)))
    assert m.find_tail(req("b", range(3), prompt_logprobs=1), 0) is None


def test_a_reused_block_is_forgotten_as_a_candidate():
    m = KVCacheManager(BS, 3)
    a = req("a", range(6))
    schedule(m, a)
    m.free(a)  # block 0 cached (hash), block 1 partial [4, 5]: both candidates, both free
    other = req("o", range(100, 112))
    schedule(m, other)  # takes every block: both evicted
    m.free(other)
    b = req("b", [0, 1, 2, 3, 4, 5, 6])
    assert m.get_computed_blocks(b)[1] == 0 and m.find_tail(b, 0) is None
    m.check_integrity()


def test_lookup_compares_a_bounded_number_of_candidates():
    m = KVCacheManager(BS, 4 * MAX_CANDIDATES + 8)
    # Many blocks under one (parent, first token): newest first, at most MAX_CANDIDATES compared.
    for i in range(MAX_CANDIDATES + 4):
        schedule(m, req(f"r{i}", [7, 1000 + i, 5, 5, 5]))
    m.begin_step()
    hit = m.find_tail(req("x", [7, 1000 + MAX_CANDIDATES + 3, 5, 9]), 0)
    assert hit is not None and hit.num_tokens == 3
    assert m.find_tail(req("y", [7, 1000, 5, 9]), 0).num_tokens == 1  # the oldest is out of reach


# --- through the engine --------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines():
    kw = dict(dtype="float32", num_threads=2, max_model_len=256, kv_cache_memory_bytes=32 << 20)
    on, off = LLM(enable_prefix_caching=True, **kw), LLM(enable_prefix_caching=False, **kw)
    yield on, off
    on.shutdown()
    off.shutdown()


def _run(llm, ids, n=8):
    out = llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=n, logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    c = out.outputs[0]
    return c.token_ids, [lp.logprob for lp in c.logprobs], out.num_cached_tokens


def test_engine_reuses_down_to_the_token_with_the_same_outputs(engines):
    on, off = engines
    system = list(range(1000, 1021))  # 21 tokens: ends 5 tokens into its second block of 16
    turn1 = system + [2000, 2001, 2002]
    chat2_q = [3000, 3001, 3002, 3003, 3004]
    cases = []
    ids1, _, _ = _run(on, turn1)
    cases.append(("turn 2 of a chat", turn1 + ids1 + chat2_q, len(turn1) + len(ids1) - 1))
    cases.append(("same system prompt, another question", system + [2100, 2101], len(system)))
    cases.append(("a repeat, 32 tokens", list(range(1000, 1032)), None))
    for name, ids, want_cached in cases:
        if want_cached is None:  # the repeat: first computed, then taken all but its last token
            _run(on, ids)
            want_cached = len(ids) - 1
        got_ids, got_lps, cached = _run(on, ids)
        exp_ids, exp_lps, _ = _run(off, ids)
        assert cached == want_cached, name
        assert got_ids == exp_ids, name
        assert max(abs(a - b) for a, b in zip(got_lps, exp_lps)) < 1e-3, name
    core = on.engine.core
    core.scheduler.check_integrity()
    assert on.stats()["blocks_used"] == 0
