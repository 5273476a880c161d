"""Several nodes (ray.cluster_utils.Cluster on this machine). Rank 0 runs in the driver, so a
group's remote ranks must land on its driver's node: an offline LLM's on the node of the user's
process (even the smallest), and two engine replicas' (actors, as Serve runs them, each in its
own STRICT_PACK placement group with bundle 0 for itself) on two different nodes, serving
correctly at the same time."""

from __future__ import annotations

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine import SamplingParams
from tests.serve_cluster import simulated_nodes
from tests.workers.conftest import hf_greedy
from workers import LLM

ARGS = dict(dtype="float32", block_size=4, num_blocks=64, max_num_batched_tokens=8, num_threads=1)
PROMPTS = [[10, 20, 30, 40, 50], list(range(100, 125)), [9]]


@pytest.fixture(scope="module")
def three_nodes():
    # Head with 1 CPU (room for one remote rank only), two nodes with 2 CPUs each.
    with simulated_nodes(1, [{"num_cpus": 2}] * 2) as cluster_and_nodes:
        yield cluster_and_nodes


def _ids(llm):
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outs]


@ray.remote(num_cpus=1)
class Replica:
    """An engine replica as Serve runs one: an actor in bundle 0 of its placement group."""

    def start(self, model_dir: str):
        import torch

        torch.set_num_threads(1)
        self.llm = LLM(model_dir, tensor_parallel_size=2, **ARGS)
        return self.llm.engine.core.executor.worker_info()

    def serve(self):
        return _ids(self.llm)

    def stop(self):
        self.llm.shutdown()


@pytest.mark.slow
def test_remote_ranks_land_on_the_drivers_node(three_nodes, tiny_llama_dir):
    cluster, nodes = three_nodes
    assert len([n for n in ray.nodes() if n["Alive"]]) == 3
    expected = [ids for ids, _ in hf_greedy(tiny_llama_dir, PROMPTS, 10)]
    head = ray.get_runtime_context().get_node_id()
    assert head not in {n.node_id for n in nodes}

    # Offline: the driver is this process, on the 1-CPU head; its remote rank goes there too.
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **ARGS)
    try:
        assert [i["node_id"] for i in llm.engine.core.executor.worker_info()] == [head, head]
        assert _ids(llm) == expected
    finally:
        llm.shutdown()

    # Two replicas: STRICT_PACK groups of 2 bundles only fit the 2-CPU nodes, one each.
    pgs = [placement_group([{"CPU": 1}] * 2, strategy="STRICT_PACK") for _ in range(2)]
    replicas = []
    try:
        ray.get([pg.ready() for pg in pgs], timeout=60)
        replicas = [
            Replica.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
            ).remote()
            for pg in pgs
        ]
        infos = ray.get([r.start.remote(str(tiny_llama_dir)) for r in replicas], timeout=180)
        group_nodes = [{i["node_id"] for i in info} for info in infos]
        assert all(len(g) == 1 for g in group_nodes), group_nodes  # remote rank beside its driver
        assert group_nodes[0] | group_nodes[1] == {n.node_id for n in nodes}  # different nodes, not the head
        for info, pg in zip(infos, pgs):
            assert [i["placement_group_id"] for i in info] == [pg.id.hex()] * 2
        results = ray.get([r.serve.remote() for r in replicas], timeout=180)  # both at once
        assert results == [expected, expected]
        ray.get([r.stop.remote() for r in replicas], timeout=60)
    finally:
        for r in replicas:
            ray.kill(r)
        for pg in pgs:
            remove_placement_group(pg)
