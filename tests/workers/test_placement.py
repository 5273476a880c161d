"""Placement: rank 0 runs in the driver and the remote ranks of a group share its node and one
placement group; several groups in one process (and node) rendezvous on their own ports; an
executor started inside a placement group (as in a Ray Serve replica with
placement_group_bundles) keeps bundle 0 for itself and puts the remote ranks in the others."""

from __future__ import annotations

import threading

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine import SamplingParams
from tests.workers.conftest import hf_greedy
from workers import LLM

# Whole engines or Ray clusters per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

ARGS = dict(dtype="float32", block_size=4, num_blocks=64, max_num_batched_tokens=8, num_threads=1)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]]


def _ids(llm, prompts, new=8):
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=new), use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outs]


def test_two_groups_on_one_node_start_together_and_do_not_collide(ray_local, tiny_llama_dir):
    expected = [ids for ids, _ in hf_greedy(tiny_llama_dir, PROMPTS, 8)]
    llms, errors = [None, None], []

    def start(i):
        try:
            llms[i] = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **ARGS)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    try:
        assert not errors, errors
        infos = [llm.engine.core.executor.worker_info() for llm in llms]
        ports = [info[0]["rendezvous"] for info in infos]
        assert ports[0] != ports[1] and all(i["rendezvous"] == info[0]["rendezvous"] for info in infos for i in info)
        for info in infos:  # rank 0 is this process (no placement group); rank 1 an actor beside it
            assert info[0]["placement_group_id"] is None and info[1]["placement_group_id"] is not None
            assert info[0]["node_id"] == info[1]["node_id"]
        assert infos[0][1]["placement_group_id"] != infos[1][1]["placement_group_id"]
        for llm in llms:
            assert _ids(llm, PROMPTS) == expected
    finally:
        for llm in llms:
            if llm is not None:
                llm.shutdown()


@ray.remote(num_cpus=1)
class FakeReplica:
    """Stands in for a Serve replica: it lives in bundle 0 (rank 0) and builds its engine in
    place; the remote rank takes bundle 1."""

    def run(self, model_dir: str, prompts):
        import torch

        torch.set_num_threads(1)
        llm = LLM(model_dir, tensor_parallel_size=2, **ARGS)
        try:
            return (
                _ids(llm, prompts),
                llm.engine.core.executor.worker_info(),
                ray.get_runtime_context().get_placement_group_id(),
            )
        finally:
            llm.shutdown()


def test_executor_uses_the_callers_placement_group(ray_local, tiny_llama_dir):
    expected = [ids for ids, _ in hf_greedy(tiny_llama_dir, PROMPTS, 8)]
    pg = placement_group([{"CPU": 1}] * 2, strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    try:
        replica = FakeReplica.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
        ).remote()
        got, info, replica_pg = ray.get(replica.run.remote(str(tiny_llama_dir), PROMPTS), timeout=180)
        assert got == expected
        assert replica_pg == pg.id.hex()
        assert [i["placement_group_id"] for i in info] == [pg.id.hex()] * 2
        assert info[0]["num_threads"] == 1 and info[1]["num_threads"] == 1
        ray.kill(replica)
    finally:
        remove_placement_group(pg)
