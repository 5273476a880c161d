"""A dead or failing rank ends generation with an EngineDeadError naming it, within seconds,
never a hang; the broken group is torn down and a new one can take its place."""
from __future__ import annotations

import threading
import time

import pytest
import ray

from engine import LLM, EngineDeadError, SamplingParams
from tests.workers.conftest import hf_greedy

ARGS = dict(dtype="float32", block_size=4, num_blocks=512, num_threads=1)


@pytest.fixture(scope="module")
def ray_two_cpus():
    """Room for exactly one tp=2 group: rebuilding only works if the dead group let go."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _break_rank_during_generation(llm: LLM, rank: int, how: str):
    ex = llm.engine.core.executor
    hit: dict = {}

    def breaker():
        while llm.engine.core.scheduler.num_steps < 10:
            time.sleep(0.005)
        if how == "kill":
            ray.kill(ex.workers[rank])
        else:
            ray.get(ex.workers[rank].fail_next_step.remote())
        hit["t"] = time.monotonic()

    th = threading.Thread(target=breaker, daemon=True)
    th.start()
    with pytest.raises(EngineDeadError) as err:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 4, SamplingParams(temperature=0, max_tokens=480), use_tqdm=False)
    elapsed = time.monotonic() - hit["t"]
    th.join()
    return err.value, elapsed


@pytest.mark.parametrize("transport,rank", [("compiled_graph", 1), ("actor_calls", 0), ("actor_calls", 1)])
def test_killed_rank_is_a_clear_error_within_seconds(ray_two_cpus, tiny_llama_dir, monkeypatch, transport, rank):
    monkeypatch.setenv("ORBITAL_TP_TRANSPORT", transport)
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **ARGS)
    try:
        err, elapsed = _break_rank_during_generation(llm, rank, "kill")
        assert elapsed < 10, elapsed
        assert f"tensor-parallel rank {rank} of 2 died" in str(err)
        with pytest.raises(EngineDeadError, match=f"rank {rank}"):  # stays dead, fails fast
            llm.engine.core.executor.check_health()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("transport", ["compiled_graph", "actor_calls"])
def test_rank_that_raises_is_named_and_nothing_hangs(ray_two_cpus, tiny_llama_dir, monkeypatch, transport):
    monkeypatch.setenv("ORBITAL_TP_TRANSPORT", transport)
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **ARGS)
    try:
        err, elapsed = _break_rank_during_generation(llm, 1, "raise")
        assert elapsed < 10, elapsed
        assert "tensor-parallel rank 1 of 2 failed" in str(err) and "injected fault" in str(err)
    finally:
        llm.shutdown()


def test_group_is_rebuilt_after_a_death(ray_two_cpus, tiny_llama_dir):
    prompt = [5, 6, 7, 8, 9]
    expected = hf_greedy(tiny_llama_dir, [prompt], 8)[0][0]
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **ARGS)
    ray.kill(llm.engine.core.executor.workers[1])
    with pytest.raises(EngineDeadError, match="rank 1"):
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    llm.shutdown()  # frees the placement group: this Ray has CPUs for one group only
    deadline = time.monotonic() + 10  # placement-group removal is asynchronous
    while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 2
    again = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **ARGS)
    try:
        out = again.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert out[0].outputs[0].token_ids == expected
    finally:
        again.shutdown()
