"""Scheduler: budgets, chunked prefill, prefix hits, preemption, aborts, stops, integrity.

The driver below plays the model runner: it samples a fixed token for every request whose
scheduled tokens reached the end of its token list (it is the test's runner, not a mock).
"""

import random

from engine.config import CacheConfig, SchedulerConfig
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput
from engine.kv_transfer.config import KVTransferConfig
from engine.outputs import TokenLogprob
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

BS = 4


def make_sched(num_blocks=32, budget=64, max_seqs=16, policy="fcfs", caching=True, max_len=1024):
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len, policy=policy),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        num_blocks,
    )


def make_req(rid, prompt, max_tokens=4, arrival=0.0, priority=0, salt=None, eos=None, **sp):
    return Request(
        rid,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, **sp),
        eos_token_id=eos,
        arrival_time=arrival,
        priority=priority,
        cache_salt=salt,
        max_tokens=max_tokens,
    )


def fake_runner(sched, so, token=lambda rid: 7, prompt_lps=False):
    out = ModelRunnerOutput()
    for rid in so.num_scheduled_tokens:
        req = sched.requests[rid]
        out.request_ids.append(rid)
        done = req.num_computed_tokens >= req.num_tokens
        out.sampled_token_ids.append([token(rid)] if done else [])
        out.logprobs.append([TokenLogprob(token(rid), -0.5, 1)] if done else None)
        if prompt_lps and req.num_computed_tokens - so.num_scheduled_tokens[rid] < req.num_prompt_tokens:
            start = req.num_computed_tokens - so.num_scheduled_tokens[rid]
            end = min(req.num_computed_tokens, req.num_prompt_tokens)
            out.prompt_logprobs[rid] = [None if p == 0 else TokenLogprob(p, -1.0, 1) for p in range(start, end)]
    return out


def step(sched, **kw):
    so = sched.schedule()
    sched.check_integrity()
    # A request preempted in this step is not resumed in the same step (memory is short).
    assert not so.preempted_request_ids & {nr.request_id for nr in so.new_requests}
    assert so.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    outs = sched.update_from_output(so, fake_runner(sched, so, **kw))
    sched.check_integrity()
    return so, {o.request_id: o for o in outs}


def run_all(sched, max_steps=500, **kw):
    results = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return results
        _, outs = step(sched, **kw)
        for rid, o in outs.items():
            r = results.setdefault(rid, {"tokens": [], "finish": None, "error": None})
            r["tokens"] += o.new_token_ids
            if o.finished:
                r["finish"], r["error"] = o.finish_reason, o.error
    raise AssertionError("did not finish")


def all_free(sched):
    pool = sched.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_blocks


def test_basic_run_to_completion_and_deltas():
    s = make_sched()
    s.add_request(make_req("a", range(6), max_tokens=3))
    so, outs = step(s)
    (nr,) = so.new_requests
    assert nr.block_ids == [0, 1] and nr.num_computed_tokens == 0 and so.num_scheduled_tokens == {"a": 6}
    assert outs["a"].new_token_ids == [7] and not outs["a"].finished
    so, _ = step(s)
    assert so.new_requests == [] and so.cached_requests[0].new_block_ids == []
    assert so.cached_requests[0].num_computed_tokens == 6 and so.num_scheduled_tokens == {"a": 1}
    so, outs = step(s)
    assert outs["a"].finish_reason == "length" and outs["a"].new_token_ids == [7]
    assert all_free(s) and not s.has_unfinished_requests()
    assert s.schedule().finished_request_ids == {"a"}


def test_chunked_prefill_tiny_budget_exact_counters():
    s = make_sched(budget=4)
    a = make_req("a", range(10), max_tokens=2)
    s.add_request(a)
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"a": 4} and a.num_computed_tokens == 4 and outs == {}
    assert so.new_requests[0].block_ids == [0]
    so, outs = step(s)
    assert so.cached_requests[0].new_block_ids == [1] and so.cached_requests[0].num_computed_tokens == 4
    assert a.num_computed_tokens == 8 and outs == {}
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"a": 2} and so.cached_requests[0].new_block_ids == [2]
    assert a.num_computed_tokens == 10 and outs["a"].new_token_ids == [7]
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"a": 1} and outs["a"].finish_reason == "length"


def test_budget_shared_running_first():
    s = make_sched(budget=6)
    s.add_request(make_req("a", range(5), max_tokens=3))
    s.add_request(make_req("b", range(100, 105), max_tokens=3))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 5, "b": 1}
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 4}
    assert [c.request_id for c in so.cached_requests] == ["a", "b"]


def test_long_prefill_threshold_caps_chunks():
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=3), CacheConfig(block_size=BS), 16
    )
    s.add_request(make_req("a", range(7)))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 3}


def test_prefix_hit_sets_cached_tokens_and_block_ids():
    s = make_sched()
    s.add_request(make_req("a", range(10), max_tokens=1))
    run_all(s)
    s.add_request(make_req("b", list(range(8)) + [99, 98, 97], max_tokens=1))
    so, outs = step(s)
    nr = so.new_requests[0]
    # Blocks 0,1 revived from the cache; a's tail block 2 was freed first and is reused... last:
    # the free queue head is 3 (never used), so b's third block is 3.
    assert nr.block_ids == [0, 1, 3] and nr.num_computed_tokens == 8
    assert so.num_scheduled_tokens == {"b": 3}
    assert outs["b"].num_cached_tokens == 8
    st = s.stats()
    assert st["prefix_cache_hits"] == 8 and st["prefix_cache_queries"] == 10 + 11


def test_siblings_share_in_same_step_with_caching_off():
    s = make_sched(caching=False)
    for i in range(3):
        s.add_request(make_req(f"s{i}", range(9), salt="n3", max_tokens=2))
    s.add_request(make_req("plain", range(9), max_tokens=2))
    so, outs = step(s)
    blocks = {nr.request_id: nr.block_ids for nr in so.new_requests}
    assert blocks == {"s0": [0, 1, 2], "s1": [0, 1, 3], "s2": [0, 1, 4], "plain": [5, 6, 7]}
    assert so.num_scheduled_tokens == {"s0": 9, "s1": 1, "s2": 1, "plain": 9}
    assert [b.ref_cnt for b in s.kv_cache_manager.block_pool.blocks[:2]] == [3, 3]
    assert len(outs) == 4
    res = run_all(s)
    assert all(len(r["tokens"]) == 1 for r in res.values()) and all_free(s)


def test_preemption_newest_first_recompute_and_completion():
    # 4 blocks of 4 tokens; each request ends up needing 3 blocks: they cannot all run.
    s = make_sched(num_blocks=4, caching=False)
    s.add_request(make_req("a", range(4), max_tokens=6, arrival=0))
    s.add_request(make_req("b", range(10, 14), max_tokens=6, arrival=1))
    so, _ = step(s)
    assert [nr.block_ids for nr in so.new_requests] == [[0], [1]]
    preempted_steps = []
    resumed = []
    results = {"a": [7], "b": [7]}
    for _ in range(50):
        if not s.has_unfinished_requests():
            break
        so, outs = step(s)
        if so.preempted_request_ids:
            preempted_steps.append(set(so.preempted_request_ids))
        resumed += [(nr.request_id, list(nr.output_token_ids)) for nr in so.new_requests]
        for rid, o in outs.items():
            results[rid] += o.new_token_ids
    assert preempted_steps and preempted_steps[0] == {"b"}  # the newest goes first
    assert resumed and resumed[0][0] == "b" and resumed[0][1]  # resumes with its outputs so far
    assert results == {"a": [7] * 6, "b": [7] * 6}
    assert s.num_preemptions >= 1 and all_free(s)


def test_request_preempts_itself_without_crash():
    # Each request grows to 9 tokens (3 blocks) and the pool has 3: when b, the newest, needs
    # a block, the victim is b itself; nothing crashes and both finish in full.
    s = make_sched(num_blocks=3, budget=64, caching=False)
    s.add_request(make_req("a", range(4), max_tokens=6, arrival=0))
    s.add_request(make_req("b", range(20, 24), max_tokens=6, arrival=1))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 4, "b": 4}
    so, _ = step(s)  # a takes block 2 for token 5; b then has none and preempts itself
    assert so.num_scheduled_tokens == {"a": 1} and so.preempted_request_ids == {"b"}
    assert s.requests["b"].status == RequestStatus.PREEMPTED and s.waiting[0].request_id == "b"
    res = run_all(s)  # a sampled 2 tokens and b 1 in the two steps above
    assert len(res["a"]["tokens"]) == 4 and len(res["b"]["tokens"]) == 5
    assert all_free(s)


def test_priority_preempts_lowest_priority():
    s = make_sched(num_blocks=4, policy="priority", caching=False)
    s.add_request(make_req("low", range(4), max_tokens=6, arrival=0, priority=5))
    s.add_request(make_req("high", range(10, 14), max_tokens=6, arrival=1, priority=0))
    first = None
    for _ in range(50):
        if not s.has_unfinished_requests():
            break
        so, _ = step(s)
        if so.preempted_request_ids and first is None:
            first = set(so.preempted_request_ids)
    assert first == {"low"} and all_free(s)


def test_priority_preempts_already_scheduled_victim():
    # low runs first (running[0]); high arrives later. When high needs a block, the victim is
    # low, already scheduled in this very step: its tokens and blocks are taken back.
    s = make_sched(num_blocks=4, policy="priority", caching=False)
    s.add_request(make_req("low", range(4), max_tokens=8, arrival=0, priority=5))
    step(s)
    s.add_request(make_req("high", range(10, 14), max_tokens=8, arrival=1, priority=0))
    preempt_step = None
    for _ in range(10):
        so, _ = step(s)
        if so.preempted_request_ids:
            preempt_step = so
            break
    assert preempt_step.preempted_request_ids == {"low"}
    assert preempt_step.num_scheduled_tokens == {"high": 1}
    assert [c.request_id for c in preempt_step.cached_requests] == ["high"]
    res = run_all(s)
    assert "high" in res and res["high"]["finish"] == "length" and all_free(s)


def test_a_victim_preempted_in_its_own_step_unpublishes_the_blocks_it_never_filled():
    """Blocks are published when scheduled. "low" schedules a prompt chunk that fills blocks 5
    and 6, then "high" needs a block and preempts it in the same step: the chunk never runs, so
    those hashes must leave the map (block 6 is reused by "high" at once; block 5 is not), or
    "low" resumed would hit its own never-written KV."""
    s = Scheduler(
        SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=64,
            policy="priority",
            long_prefill_token_threshold=8,
        ),
        CacheConfig(block_size=BS, enable_prefix_caching=True),
        7,
    )
    prompt = list(range(100, 124))
    s.add_request(make_req("low", prompt, max_tokens=4, arrival=0, priority=5))
    step(s)  # chunk 1: blocks 0, 1
    s.add_request(make_req("high", range(4), max_tokens=8, arrival=1, priority=0))
    step(s)  # low's chunk 2 (blocks 2, 3) and high's prompt (block 4)
    so, _ = step(s)  # low schedules chunk 3 (blocks 5, 6), high's decode needs a block: low goes
    assert so.preempted_request_ids == {"low"} and so.num_scheduled_tokens == {"high": 1}
    probe = make_req("probe", prompt + [1])
    assert s.kv_cache_manager.get_computed_blocks(probe)[1] == 16  # the two chunks that ran
    res = run_all(s)
    assert res["low"]["finish"] == "length" and res["high"]["finish"] == "length" and all_free(s)


def test_priority_policy_order():
    s = make_sched(max_seqs=1, policy="priority")
    s.add_request(make_req("late_low", range(4), max_tokens=1, arrival=0, priority=3))
    s.add_request(make_req("high_b", range(4), max_tokens=1, arrival=2, priority=1))
    s.add_request(make_req("high_a", range(4), max_tokens=1, arrival=1, priority=1))
    order = []
    while s.has_unfinished_requests():
        so, _ = step(s)
        order += [nr.request_id for nr in so.new_requests]
    assert order == ["high_a", "high_b", "late_low"]


def test_fcfs_order_and_max_num_seqs():
    s = make_sched(max_seqs=2)
    for i, rid in enumerate(["x", "y", "z"]):
        s.add_request(make_req(rid, range(4), max_tokens=3, arrival=i))
    so, _ = step(s)
    assert [nr.request_id for nr in so.new_requests] == ["x", "y"] and len(s.running) == 2
    so, _ = step(s)
    assert so.new_requests == [] and len(s.running) == 2
    so, _ = step(s)
    assert so.new_requests == [] and len(s.running) == 0  # x and y finished
    so, _ = step(s)
    assert [nr.request_id for nr in so.new_requests] == ["z"]


def test_request_too_big_for_pool_errors():
    s = make_sched(num_blocks=4)
    s.add_request(make_req("big", range(10), max_tokens=8))  # 17 tokens -> 5 blocks > 4
    s.add_request(make_req("ok", range(4), max_tokens=2))
    res = run_all(s)
    assert res["big"]["finish"] == "error" and "KV blocks" in res["big"]["error"]
    assert res["ok"]["tokens"] == [7, 7] and all_free(s)


def test_abort_waiting_running_preempted_frees_blocks():
    s = make_sched(num_blocks=4, caching=False)
    s.add_request(make_req("a", range(4), max_tokens=8, arrival=0))
    s.add_request(make_req("b", range(10, 14), max_tokens=8, arrival=1))
    s.add_request(make_req("w", range(20, 36), max_tokens=1, arrival=2))
    for _ in range(20):
        step(s)
        if s.requests["b"].status == RequestStatus.PREEMPTED:
            break
    assert s.requests["b"].status == RequestStatus.PREEMPTED
    assert s.requests["w"].status == RequestStatus.WAITING
    s.abort_requests(["b", "w"])
    s.check_integrity()
    assert s.requests.keys() == {"a"}
    s.abort_requests("a")  # running
    s.check_integrity()
    assert all_free(s) and not s.has_unfinished_requests()
    assert s.schedule().finished_request_ids == {"a", "b", "w"}


def test_abort_between_schedule_and_update():
    s = make_sched()
    s.add_request(make_req("a", range(5)))
    so = s.schedule()
    mro = fake_runner(s, so)
    s.abort_requests("a")
    assert s.update_from_output(so, mro) == [] and all_free(s)


def test_finish_requests_stop_string():
    s = make_sched()
    s.add_request(make_req("a", range(5), max_tokens=10))
    step(s)
    s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert all_free(s) and s.get_num_unfinished() == 0


def test_stop_conditions():
    s = make_sched(max_len=8)
    s.add_request(make_req("eos", range(4), max_tokens=10, eos=7, min_tokens=3))
    s.add_request(make_req("ign", range(4), max_tokens=3, eos=7, ignore_eos=True))
    s.add_request(make_req("stop", range(4), max_tokens=10, stop_token_ids=[7]))
    s.add_request(make_req("ctx", range(4), max_tokens=100))  # hits max_model_len=8
    res = {}
    while s.has_unfinished_requests():
        _, outs = step(s)
        for rid, o in outs.items():
            if o.finished:
                res[rid] = (o.finish_reason, o.stop_reason)
    assert res["eos"] == ("stop", None)
    assert res["stop"] == ("stop", 7)
    assert res["ign"] == ("length", None)
    assert res["ctx"] == ("length", None)


def test_output_lengths_for_stops():
    s = make_sched(max_len=8)
    s.add_request(make_req("eos", range(4), max_tokens=10, eos=7, min_tokens=3))
    s.add_request(make_req("stop", range(4), max_tokens=10, stop_token_ids=[7]))
    s.add_request(make_req("ctx", range(4), max_tokens=100))
    res = run_all(s)
    assert len(res["eos"]["tokens"]) == 3  # EOS suppressed until min_tokens outputs
    assert len(res["stop"]["tokens"]) == 1
    assert len(res["ctx"]["tokens"]) == 4  # 4 prompt + 4 outputs = max_model_len


def test_prompt_logprobs_accumulated_and_emitted_once():
    s = make_sched(budget=3)
    s.add_request(make_req("a", range(7), max_tokens=2, prompt_logprobs=1))
    emitted = []
    while s.has_unfinished_requests():
        _, outs = step(s, prompt_lps=True)
        if "a" in outs and outs["a"].prompt_logprobs is not None:
            emitted.append(outs["a"].prompt_logprobs)
    (lps,) = emitted
    assert len(lps) == 7 and lps[0] is None and [lp.token_id for lp in lps[1:]] == [1, 2, 3, 4, 5, 6]


def test_randomized_integrity_every_step():
    rng = random.Random(1234)
    total_preemptions = total_hits = 0
    for trial in range(10):
        num_blocks = rng.randint(4, 10)
        s = make_sched(
            num_blocks=num_blocks,
            budget=rng.randint(3, 24),
            max_seqs=rng.randint(1, 5),
            policy=rng.choice(["fcfs", "priority"]),
            caching=rng.random() < 0.7,
        )
        expected = {}
        prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
        for i in range(12):
            prompt = rng.choice(prefixes)[: rng.randint(1, 8)] + [rng.randrange(50) for _ in range(rng.randint(0, 6))]
            mt = rng.randint(1, 10)
            rid = f"t{trial}r{i}"
            s.add_request(
                make_req(
                    rid,
                    prompt,
                    max_tokens=mt,
                    arrival=i,
                    priority=rng.randint(0, 2),
                    salt=rng.choice([None, None, "s"]),
                )
            )
            expected[rid] = (mt, -(-(len(prompt) + mt - 1) // BS) > num_blocks)
        aborted = set()
        got = {rid: [] for rid in expected}
        errors = set()
        for _ in range(600):
            if not s.has_unfinished_requests():
                break
            if rng.random() < 0.05 and s.requests:
                victim = rng.choice(sorted(s.requests))
                s.abort_requests([victim])
                aborted.add(victim)
                s.check_integrity()
            _, outs = step(s, token=lambda rid: 3)
            for rid, o in outs.items():
                if o.error is not None:
                    errors.add(rid)
                got[rid] += o.new_token_ids
        assert not s.has_unfinished_requests(), "simulation did not finish"
        assert errors == {rid for rid, (_, too_big) in expected.items() if too_big}
        for rid, (mt, too_big) in expected.items():
            if rid not in aborted and not too_big:
                assert got[rid] == [3] * mt, (rid, got[rid], mt)
        assert all_free(s)
        st = s.stats()
        assert st["num_running"] == st["num_waiting"] == 0 and st["kv_usage"] == 0.0
        total_preemptions += st["num_preemptions"]
        total_hits += st["prefix_cache_hits"]
    # The simulation must actually exercise preemption and prefix hits.
    assert total_preemptions > 0 and total_hits > 0


def test_remote_kv_resume_waits_for_a_block():
    """Decode side: a request whose remote KV arrived while the pool is full keeps its blocks
    and waits at the head of the queue until its next block frees, then finishes normally."""
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024),
        CacheConfig(block_size=BS),
        6,
        kv_transfer=KVTransferConfig("decode", local_prefill_max_tokens=0),
    )
    a = make_req("a", range(100, 109), max_tokens=2)  # KV of 8 tokens fetched: 2 full blocks
    s.add_request(a)
    step(s)
    [load] = s.take_kv_loads()
    assert load.num_tokens == 8 and s.kv_cache_manager.get_block_ids("a") == [0, 1]
    s.add_request(make_req("b", range(200, 214), max_tokens=2, prompt_logprobs=1))  # local: 4 blocks
    step(s)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    s.remote_kv_done("a", loaded=True)
    so, _ = step(s)  # a needs a 3rd block for its last prompt token: none is free
    assert "a" not in so.num_scheduled_tokens and s.kv_cache_manager.get_block_ids("a") == [0, 1]
    results = run_all(s)
    assert results["a"]["tokens"] == [7, 7] and results["a"]["finish"] == "length"
    assert all_free(s)
