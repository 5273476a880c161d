"""The pools on different nodes and at different tensor-parallel degrees: a 3-node
ray.cluster_utils.Cluster on this machine, the prefill pool (tp=1) pinned to one worker node
and the decode pool (tp=3, one KV head per rank) to the other through custom node resources
(`prefill_replica_resources` / `replica_resources`). The KV crosses nodes through Ray's object
store and its heads are re-sliced 1 -> 3 ranks; greedy outputs equal the colocated engine's."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from engine import SamplingParams
from tests.disagg.conftest import PD_BASE
from tests.disagg.test_outputs import DOC
from tests.net import free_port, wait_healthy
from tests.serve_cluster import simulated_nodes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [
    "The capital of France is",  # prefilled by the decode replica itself
    DOC + "Summarise the log in one sentence:",
    "Second copy. " + DOC * 2 + "Who kept the log?",
]


@pytest.fixture(scope="module")
def two_pool_nodes():
    from ray import serve

    from router.app import build_app
    from router.config import AppConfig

    nodes = [{"num_cpus": 2, "resources": {"prefill_node": 1}}, {"num_cpus": 4, "resources": {"decode_node": 1}}]
    with simulated_nodes(1, nodes) as (cluster, (prefill_node, decode_node)):
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        cfg = AppConfig(
            **{**PD_BASE, "kv_cache_memory_bytes": 16 << 20},
            tensor_parallel_size=3,
            replica_resources={"decode_node": 1},
            prefill_tensor_parallel_size=1,
            prefill_replica_resources={"prefill_node": 1},
        )
        handle = serve.run(build_app(cfg), name="pd-nodes", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=300)
        try:
            yield {
                "url": url,
                "handle": handle,
                "prefill_node": prefill_node.node_id,
                "decode_node": decode_node.node_id,
            }
        finally:
            serve.shutdown()


def test_pools_on_two_nodes_with_different_tp(two_pool_nodes):
    from engine import LLM

    url, handle = two_pool_nodes["url"], two_pool_nodes["handle"]
    [decode] = handle.replica_stats.remote().result()
    [prefill] = handle.replica_stats.remote("prefill").result()
    assert decode["node_id"] == two_pool_nodes["decode_node"]
    assert prefill["node_id"] == two_pool_nodes["prefill_node"]

    async def run():
        async with httpx.AsyncClient(timeout=300) as c:
            rs = await asyncio.gather(
                *(
                    c.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": 20, "temperature": 0})
                    for p in PROMPTS
                )
            )
        return [r.json()["choices"][0]["text"] for r in rs]

    got = asyncio.run(run())
    llm = LLM(dtype="float32", kv_cache_memory_bytes=16 << 20, num_threads=1)
    try:
        refs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    finally:
        llm.shutdown()
    assert got == [r.outputs[0].text for r in refs]
    [decode] = handle.replica_stats.remote().result()
    assert decode["kv_transfers"] == 2 and decode["num_local_prefills"] >= 1
    assert decode["kv_transfer_failures"] == 0
