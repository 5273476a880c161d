"""`LLM(model, tensor_parallel_size=2)` with no Ray running starts a local Ray, serves, and
shuts down what it started."""

from __future__ import annotations

import pytest
import ray

from engine import SamplingParams
from tests.serve_cluster import release_ray
from tests.workers.conftest import hf_greedy
from workers import LLM

# Whole engines or Ray clusters per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow


def test_offline_llm_starts_and_stops_its_own_ray(tiny_llama_dir):
    release_ray()  # the shared Serve cluster (tests/serve_cluster.py), if it runs
    prompts = [[11, 22, 33], list(range(60, 90))]
    expected = [ids for ids, _ in hf_greedy(tiny_llama_dir, prompts, 6)]
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", num_blocks=64, num_threads=1)
    try:
        assert ray.is_initialized()
        ex = llm.engine.core.executor
        assert type(ex).__name__ == "RayExecutor"
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
        )
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        llm.shutdown()
    assert not ray.is_initialized()
