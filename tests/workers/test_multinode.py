"""Several nodes (ray.cluster_utils.Cluster on this machine): a tp=2 group's actors land on
one node, two groups land on different nodes, and both generate correctly at the same time."""
from __future__ import annotations

import threading

import pytest
import ray

from engine import LLM, SamplingParams
from tests.workers.conftest import hf_greedy

ARGS = dict(dtype="float32", block_size=4, num_blocks=64, max_num_batched_tokens=8, num_threads=1)
PROMPTS = [[10, 20, 30, 40, 50], list(range(100, 125)), [9]]


@pytest.fixture(scope="module")
def three_nodes():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    # Head with 1 CPU (no room for a tp=2 group), two nodes with 2 CPUs each.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow
def test_groups_pack_on_one_node_each_and_serve(three_nodes, tiny_llama_dir):
    cluster, nodes = three_nodes
    assert len([n for n in ray.nodes() if n["Alive"]]) == 3
    expected = [ids for ids, _ in hf_greedy(tiny_llama_dir, PROMPTS, 10)]
    llms = [LLM(str(tiny_llama_dir), tensor_parallel_size=2, **ARGS) for _ in range(2)]
    try:
        infos = [llm.engine.core.executor.worker_info() for llm in llms]
        group_nodes = [{i["node_id"] for i in info} for info in infos]
        assert all(len(g) == 1 for g in group_nodes), group_nodes  # STRICT_PACK: one node per group
        assert group_nodes[0] != group_nodes[1]
        assert group_nodes[0] | group_nodes[1] == {n.node_id for n in nodes}  # not the 1-CPU head

        results, errors = [None, None], []

        def serve(k):
            try:
                outs = llms[k].generate([{"prompt_token_ids": p} for p in PROMPTS],
                                        SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
                results[k] = [o.outputs[0].token_ids for o in outs]
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=serve, args=(k,)) for k in range(2)]
        [t.start() for t in threads]
        [t.join(timeout=120) for t in threads]
        assert not errors, errors
        assert results == [expected, expected]
    finally:
        for llm in llms:
            llm.shutdown()
