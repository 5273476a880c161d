"""Pipeline micro-batches (Executor.max_concurrent_batches > 1): the engine keeps several steps in
flight, and no request is in two of them. The pipelined Ray executor is not needed to check the
engine's side: the executor here is the in-process one with each step run at its completion
call, in launch order, as a pipeline's stages run them, and it records what was in flight at
once. Greedy outputs must equal the one-step engine's exactly (the chat stand-in's wide weights
keep its logits far from ties), through chunked prefills, prefix hits on blocks a step in flight
fills, aborts, preemption and a step that fails.

The first tests drive the scheduler alone (tests/engine/test_scheduler.py's runner) to pin the
rules: a request in a step in flight is neither scheduled nor preempted, a schedule with nothing
to run hands its ids to forget to the next step, a failed step's followers are rolled back.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.engine_args import EngineArgs
from engine.request import RequestStatus
from engine.runner.executor import InProcessExecutor
from engine.runner.sampling_metadata import SamplingMetadata
from tests.engine.test_kv_transfer import _assert_pools_whole
from tests.engine.test_scheduler import all_free, fake_runner, make_req, make_sched, run_all

# --- the scheduler alone ----------------------------------------------------------------------


def test_a_request_in_a_step_in_flight_is_not_scheduled_again():
    s = make_sched(budget=8)
    s.add_request(make_req("a", range(20)))
    so1 = s.schedule()  # a's first chunk
    s.add_request(make_req("b", range(100, 106)))
    so2 = s.schedule()  # a is in flight: only b
    assert so1.num_scheduled_tokens == {"a": 8} and so2.num_scheduled_tokens == {"b": 6}
    assert s.in_pipe == {"a", "b"} and not s.can_launch()
    s.update_from_output(so1, fake_runner(s, so1))
    assert s.in_pipe == {"b"} and s.can_launch()
    so3 = s.schedule()
    assert so3.num_scheduled_tokens == {"a": 8}  # b (its token not in yet) is left alone
    for so in (so2, so3):
        s.update_from_output(so, fake_runner(s, so))
    assert not s.in_pipe
    results = run_all(s)
    assert results["a"]["finish"] == results["b"]["finish"] == "length"
    s.check_integrity()
    assert all_free(s)


def test_a_victim_is_never_in_a_step_in_flight():
    s = make_sched(num_blocks=5)
    s.add_request(make_req("a", range(11)))
    so = s.schedule()
    s.update_from_output(so, fake_runner(s, so))  # a: 3 blocks, 12 tokens
    so1 = s.schedule()  # a's decode fills its third block
    s.add_request(make_req("b", range(50, 58)))
    so2 = s.schedule()  # b (newest) takes the last 2 blocks and stays in flight
    assert so1.num_scheduled_tokens == {"a": 1} and so2.num_scheduled_tokens == {"b": 8}
    s.update_from_output(so1, fake_runner(s, so1))
    so3 = s.schedule()  # a needs a 4th block: the newest, b, is in flight, so a gives way itself
    assert so3.preempted_request_ids == {"a"} and not so3.num_scheduled_tokens
    assert s.requests["b"].status == RequestStatus.RUNNING and s.requests["a"].status == RequestStatus.PREEMPTED
    s.carry(so3)
    s.update_from_output(so2, fake_runner(s, so2))
    assert s.schedule().preempted_request_ids == {"a"}  # carried to the runner by the next step
    s.check_integrity()


def test_a_schedule_not_launched_hands_its_ids_to_forget_to_the_next():
    s = make_sched()
    s.add_request(make_req("a", range(6)))
    s.add_request(make_req("w", range(6), max_tokens=4))
    so1 = s.schedule()  # a and w in flight
    mro = fake_runner(s, so1)
    s.abort_requests("w")
    so2 = s.schedule()
    assert so2.only_forgets and so2.finished_request_ids == {"w"}
    s.carry(so2)
    assert [o.request_id for o in s.update_from_output(so1, mro)] == ["a"]  # w's token dropped
    assert s.schedule().finished_request_ids == {"w"}


def test_a_failed_step_leaves_no_prefix_hit_on_the_blocks_it_never_filled():
    """b hits the blocks a's step is filling, a is aborted, then that step fails. b's step is
    rolled back first with none of its blocks trusted, so no hit on a's blocks is left; x and y,
    new in the failed step, are quarantined (step_faults.py); everyone else recomputes."""
    s = make_sched()
    prompt = list(range(16))
    for rid, p in [("a", prompt), ("x", range(50, 55)), ("y", range(60, 65))]:
        s.add_request(make_req(rid, p))
    so1 = s.schedule()
    s.add_request(make_req("b", prompt + [90, 91, 92, 93]))
    so2 = s.schedule()
    assert so2.num_scheduled_tokens == {"b": 4}  # 16 tokens hit the blocks so1 fills
    s.abort_requests("a")
    s.roll_back(so2, fake_runner(s, so2))
    assert s.isolate_fault(so1, ValueError("boom")) == []
    assert not s.in_pipe and s.faults.quarantined == {"x", "y"}
    assert s.requests["b"].status == RequestStatus.PREEMPTED and s.requests["b"].num_computed_tokens == 0
    s.add_request(make_req("c", prompt + [7]))
    assert s.kv_cache_manager.get_computed_blocks(s.requests["c"]) == ([], 0)
    s.check_integrity()
    so = s.schedule()  # a suspect alone; the runner is told to drop b, x and y
    assert so.preempted_request_ids == {"b", "x", "y"} and list(so.num_scheduled_tokens) in (["x"], ["y"])
    s.update_from_output(so, fake_runner(s, so))
    results = run_all(s)
    assert {r: results[r]["finish"] for r in "bcxy"} == dict.fromkeys("bcxy", "length")
    s.check_integrity()
    assert all_free(s)


# --- the engine, with steps run at their completion -------------------------------------------


class DeferredExecutor(InProcessExecutor):
    """Two steps in flight; each runs when completed, in launch order. Records the most steps in
    flight at once and every rule broken (kept, not raised: the engine treats a step's exception
    as a fault to isolate)."""

    max_concurrent_batches = 2

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.in_flight: list[SchedulerOutput] = []
        self.most_in_flight = 0
        self.broken: list[str] = []

    def launch_model(self, so: SchedulerOutput):
        mine = set(so.num_scheduled_tokens)
        for other in self.in_flight:
            held = set(other.num_scheduled_tokens)
            self.broken += [f"{r} scheduled in two steps in flight" for r in mine & held]
            self.broken += [f"{r} preempted in its step in flight" for r in so.preempted_request_ids & held]
        self.in_flight.append(so)
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))

        def complete() -> ModelRunnerOutput:
            if self.in_flight[0] is not so:
                self.broken.append("a step completed out of launch order")
            self.in_flight.remove(so)
            return self.execute_model(so)

        return complete


def deferred(model_config, cache_config, parallel, device="cpu", cuda_graph_max_batch=0) -> DeferredExecutor:
    return DeferredExecutor(model_config, cache_config, device, cuda_graph_max_batch)


KW = dict(dtype="float32", num_threads=1, block_size=8, max_num_batched_tokens=32, max_model_len=256)
LENGTHS = [5, 13, 29, 47, 64, 9, 83, 21]
MAX_TOKENS = [12, 20, 7, 25, 16, 30, 10, 18]


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in LENGTHS]
    prompts[6][:24] = prompts[3][:24]  # a shared prefix: hits on blocks a step in flight fills
    return prompts


PROMPTS = _prompts()
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]


def _tokens(outs) -> list[tuple]:
    return [(tuple(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


def _generate(llm: LLM, prompts=PROMPTS, params=PARAMS) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def expected(chat_stand_in):
    llm = LLM(chat_stand_in, num_blocks=256, **KW)
    try:
        assert llm.engine.core.max_in_flight == 1
        return _tokens(_generate(llm))
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def micro_engine(chat_stand_in):
    llm = LLM(chat_stand_in, executor_factory=deferred, num_blocks=256, **KW)
    yield llm
    llm.shutdown()


@pytest.fixture
def micro(micro_engine):
    """With the last test's prompts cached, each prompt would need one step's worth of tokens and
    every request would share one step: nothing left for a second."""
    micro_engine.engine.core.scheduler.reset_prefix_cache()
    return micro_engine


def _check_whole(llm: LLM) -> None:
    ex = llm.engine.core.executor
    assert ex.broken == [] and not ex.in_flight
    assert not llm.engine.step_in_flight and not llm.engine.core.scheduler.in_pipe
    _assert_pools_whole(llm)


def test_greedy_outputs_equal_the_one_step_engine(micro, expected):
    got = _tokens(_generate(micro))
    assert got == expected
    stats = micro.stats()
    assert micro.engine.core.executor.most_in_flight == 2 and stats["max_steps_in_flight"] == 2, stats
    assert stats["num_steps_in_flight"] == 0 and stats["prefix_cache_hits"] > 0, stats
    _check_whole(micro)


def test_aborts_while_steps_are_in_flight_return_every_block(micro, expected):
    eng = micro.engine
    ids = [eng.add_request(None, {"prompt_token_ids": p}, sp) for p, sp in zip(PROMPTS, PARAMS)]
    results, aborted = {}, set()
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id not in aborted
            if out.finished:
                results[out.request_id] = out
        in_pipe = eng.core.scheduler.in_pipe & set(ids)
        if not aborted and eng.core.num_in_flight == 1 and len(in_pipe) >= 3:
            victims = sorted(in_pipe)[:3]  # requests of the step in flight
            for rid in victims:
                eng.abort_request(rid)
            aborted.update(victims)
    assert len(aborted) == 3
    assert set(results) == set(ids) - aborted
    for i, rid in enumerate(ids):
        if rid not in aborted:
            assert _tokens([results[rid]]) == [expected[i]]
    _check_whole(micro)
    eng.step()  # idle: the last ids to forget reach the runner
    assert not eng.core.executor.runner.states


def test_preemption_on_a_small_pool_keeps_greedy_outputs(chat_stand_in, expected):
    llm = LLM(chat_stand_in, executor_factory=deferred, num_blocks=14, **KW)
    try:
        got = _tokens(_generate(llm))
        stats = llm.stats()
        assert got == expected
        assert stats["num_preemptions"] > 0 and stats["max_steps_in_flight"] == 2, stats
        _check_whole(llm)
    finally:
        llm.shutdown()


def test_a_request_that_breaks_its_step_fails_alone_with_steps_in_flight(micro, expected, monkeypatch):
    """The failed step is isolated (step_faults.py), any step launched after it is rolled back,
    the others finish with their greedy outputs."""
    poison_seed = 4242
    original = SamplingMetadata.build.__func__

    def build(cls, params, *args, **kwargs):
        if any(p.seed == poison_seed for p in params):
            raise ValueError("poisoned step")
        return original(cls, params, *args, **kwargs)

    monkeypatch.setattr(SamplingMetadata, "build", classmethod(build))
    poison = SamplingParams(temperature=1.0, seed=poison_seed, max_tokens=5)
    got = _generate(micro, PROMPTS + [[5, 6, 7]], PARAMS + [poison])
    bad = got.pop()
    assert bad.outputs[0].finish_reason == "error" and bad.error_kind == "internal"
    assert _tokens(got) == expected
    assert micro.stats()["num_request_faults"] == 1
    _check_whole(micro)


def test_async_engine_streams_with_steps_in_flight(chat_stand_in, expected):
    async def run():
        eng = AsyncEngine(EngineArgs(model=chat_stand_in, num_blocks=256, **KW), executor_factory=deferred)
        try:

            async def one(i):
                last = None
                async for out in eng.generate({"prompt_token_ids": PROMPTS[i]}, PARAMS[i], f"r{i}"):
                    last = out
                return last

            outs = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
            return outs, eng.stats(), eng.engine.core.executor.broken
        finally:
            eng.shutdown()

    outs, stats, broken = asyncio.run(run())
    assert _tokens(outs) == expected and broken == []
    assert stats["max_steps_in_flight"] == 2 and stats["blocks_used"] == 0, stats
