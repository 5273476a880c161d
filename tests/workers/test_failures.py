"""A dead or failing rank ends generation with an EngineDeadError naming it, within seconds,
never a hang: a remote rank (actor) killed or raising mid-generation while rank 0, in the
driver, is blocked in a collective with it, or rank 0 itself raising while the remote rank
waits on it. The broken group is torn down and a new one can take its place."""

from __future__ import annotations

import re
import threading
import time

import pytest
import ray

from engine import EngineDeadError, SamplingParams
from tests.serve_cluster import release_ray
from tests.workers.conftest import hf_greedy
from workers import LLM

# Whole engines or Ray clusters per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

ARGS = dict(dtype="float32", block_size=4, num_blocks=512, num_threads=1)


@pytest.fixture(scope="module")
def ray_one_cpu():
    """Room for exactly one tp=2 group (one remote rank): rebuilding only works if the dead
    group let go."""
    release_ray()  # the shared Serve cluster (tests/serve_cluster.py), if it runs
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _break_during_generation(llm: LLM, how: str):
    ex = llm.engine.core.executor
    hit: dict = {}

    def breaker():
        while llm.engine.core.scheduler.num_steps < 10:
            time.sleep(0.005)
        if how == "kill":
            ray.kill(ex.workers[0])  # rank 1
        elif how == "raise":  # from outside: rank 1's model runner raises on its next step

            def raise_once(worker):  # runs inside the actor (nested: pickled by value)
                import weakref

                # Only a weak reference: the raised error's frames keep `broken` alive, and a
                # strong one would keep the runner and its process group open after the rank
                # drops them, so rank 0 would wait out the collective timeout.
                runner = weakref.ref(worker.runner)

                def broken(so):
                    del runner().execute_model  # the class's method again
                    raise RuntimeError("injected fault")

                worker.runner.execute_model = broken

            ray.get(ex.workers[0].__ray_call__.remote(raise_once))
        else:  # rank 0, in this process, raises inside its model step
            runner, inner = ex.rank0.runner, ex.rank0.runner.execute_model

            def broken(so):
                runner.execute_model = inner
                raise RuntimeError("injected driver fault")

            runner.execute_model = broken
        hit["t"] = time.monotonic()

    th = threading.Thread(target=breaker, daemon=True)
    th.start()
    with pytest.raises(EngineDeadError) as err:
        llm.generate(
            [{"prompt_token_ids": [1, 2, 3]}] * 4, SamplingParams(temperature=0, max_tokens=480), use_tqdm=False
        )
    elapsed = time.monotonic() - hit["t"]
    th.join()
    return err.value, elapsed


@pytest.mark.parametrize(
    "how,message",
    [
        ("kill", "tensor-parallel rank 1 of 2 died"),
        (
            "raise",
            "tensor-parallel rank 1 of 2 failed: RuntimeError: tensor-parallel rank 1 failed: RuntimeError: injected fault",
        ),
        ("driver", "tensor-parallel rank 0 of 2 (in the driver) failed: RuntimeError: injected driver fault"),
    ],
)
def test_broken_rank_is_a_clear_error_within_seconds(ray_one_cpu, tiny_llama_dir, how, message):
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **ARGS)
    try:
        err, elapsed = _break_during_generation(llm, how)
        print(f"{how}: EngineDeadError {elapsed:.2f}s after the break")
        assert elapsed < 10, elapsed
        assert message in str(err), str(err)
        with pytest.raises(EngineDeadError, match=re.escape(message.split(":")[0])):  # stays dead, fails fast
            llm.engine.core.executor.check_health()
    finally:
        t = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - t < 10  # nothing left blocked in a collective


@pytest.mark.slow
def test_group_is_rebuilt_after_a_death(ray_one_cpu, tiny_llama_dir):
    prompt = [5, 6, 7, 8, 9]
    expected = hf_greedy(tiny_llama_dir, [prompt], 8)[0][0]
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **ARGS)
    ray.kill(llm.engine.core.executor.workers[0])
    with pytest.raises(EngineDeadError, match="rank 1"):
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    llm.shutdown()  # frees the placement group: this Ray has CPUs for one group only
    deadline = time.monotonic() + 10  # placement-group removal is asynchronous
    while ray.available_resources().get("CPU") != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 1
    again = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **ARGS)
    try:
        out = again.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert out[0].outputs[0].token_ids == expected
    finally:
        again.shutdown()
