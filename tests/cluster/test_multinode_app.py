"""The app on three nodes (ray.cluster_utils.Cluster on this machine): each engine replica's
tensor-parallel group lands whole on one node, the pool's replicas spread over nodes
(`placement.max_replicas_per_node: 1`, nodes advertise `orbital_node: 1` as the `ray up` configs
do), and requests succeed through the HTTP proxy.

Nodes: a 1-CPU head (controller, proxy, router; too small for a tp=2 group) and two 4-CPU
workers, the second added while the app deploys: the first worker could hold both tp=2
groups, so only the spread rule keeps the second replica waiting for the new node.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import ray

from tests.cluster.helpers import complete, free_port, replica_states, stream_completion, wait_healthy
from tests.serve_cluster import release_ray
from tests.tiny_llama import save_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

APP = "multinode"
SPREAD = {"orbital_node": 1}


@pytest.fixture(scope="module")
def three_node_app(tmp_path_factory, smollm_dir):
    """Deploys on head + one worker first: one replica runs, the other waits (the worker has CPUs
    for it, but its spread share is taken); the third node then takes it (what Ray's cluster
    autoscaler does for a pending replica on a `ray up` cluster)."""
    from ray import serve
    from ray.cluster_utils import Cluster

    from router.app import build_app
    from router.config import AppConfig

    model_dir = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-serve"), tokenizer_from=smollm_dir)
    release_ray()  # the shared Serve cluster (tests/serve_cluster.py), if it runs
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "resources": SPREAD, "include_dashboard": False}
    )
    deployer = None
    try:
        first = cluster.add_node(num_cpus=4, resources=SPREAD)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        cfg = AppConfig(
            model=str(model_dir),
            dtype="float32",
            tensor_parallel_size=2,
            cpus_per_worker=1.0,
            num_threads=1,
            kv_cache_memory_bytes=8 << 20,
            max_model_len=256,
            autoscaling={
                "pools": {
                    "engine": {
                        "min_replicas": 2,
                        "max_replicas": 2,
                        "metrics_interval_s": 1.0,
                        "look_back_period_s": 5.0,
                        "placement": {"max_replicas_per_node": 1},
                    }
                }
            },
        )
        box: dict = {}
        deployer = threading.Thread(
            target=lambda: box.update(handle=serve.run(build_app(cfg), name=APP, route_prefix="/")), daemon=True
        )
        deployer.start()
        deadline = time.monotonic() + 240
        while replica_states(APP).get("RUNNING", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(5.0)  # room for a wrongly packed second replica to show up on `first`
        before = {"states": replica_states(APP), "groups": _engine_groups(any_state=True)}
        t_add = time.monotonic()
        second = cluster.add_node(num_cpus=4, resources=SPREAD)
        deployer.join(timeout=240)
        assert "handle" in box, "the app never became ready after the third node joined"
        placed_s = time.monotonic() - t_add
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=120)
        yield {
            "url": url,
            "handle": box["handle"],
            "head": cluster.head_node.node_id,
            "first": first.node_id,
            "second": second.node_id,
            "before": before,
            "placed_after_add_s": placed_s,
        }
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
            if deployer is not None:
                deployer.join(timeout=30)


def _engine_groups(any_state: bool = False) -> list[dict]:
    return [
        pg
        for pg in ray.util.placement_group_table().values()
        if "EngineReplica" in (pg.get("name") or "") and (any_state or pg["state"] == "CREATED")
    ]


def test_spread_keeps_second_replica_off_a_node_with_room(three_node_app):
    before = three_node_app["before"]
    assert before["states"].get("RUNNING") == 1 and sum(before["states"].values()) == 2, before["states"]
    states = sorted(pg["state"] for pg in before["groups"])
    assert states == ["CREATED", "PENDING"], states
    created = next(pg for pg in before["groups"] if pg["state"] == "CREATED")
    assert set(created["bundles_to_node_id"].values()) == {three_node_app["first"]}
    print(f"second replica placed {three_node_app['placed_after_add_s']:.1f}s after its node joined")


def test_tp_groups_whole_on_one_node_and_spread(three_node_app):
    assert replica_states(APP) == {"RUNNING": 2}
    groups = _engine_groups()
    assert len(groups) == 2, groups
    nodes = []
    for pg in groups:
        assert pg["strategy"] == "STRICT_PACK" and len(pg["bundles"]) == 2
        assert pg["bundles"][0].get("orbital_node") == 1.0  # the spread share (1 per node)
        on = set(pg["bundles_to_node_id"].values())
        assert len(on) == 1, pg["bundles_to_node_id"]  # the whole tp group on one node
        nodes.append(on.pop())
    assert len(set(nodes)) == 2, nodes  # replicas spread: one per node
    assert set(nodes) == {three_node_app["first"], three_node_app["second"]}  # the 1-CPU head holds none

    # Rank 0 is the replica actor itself; the other rank (a TPWorker it owns) runs on the node of
    # that replica's placement group (Serve names the group after the replica actor).
    actors = [a for a in ray._private.state.actors().values() if a["State"] == "ALIVE"]
    for pg in groups:
        node = next(iter(pg["bundles_to_node_id"].values()))
        replica = [a for a in actors if a["Name"] == pg["name"]]
        assert len(replica) == 1 and replica[0]["Address"]["NodeID"] == node, (pg["name"], replica)
        owner = replica[0]["Address"]
        ranks = [
            a
            for a in actors
            if a["ActorClassName"] == "TPWorker"
            and (a["OwnerAddress"]["IPAddress"], a["OwnerAddress"]["Port"]) == (owner["IPAddress"], owner["Port"])
        ]
        assert len(ranks) == 1, [(a["ActorClassName"], a["OwnerAddress"]) for a in actors]  # tp=2: rank 1
        assert {a["Address"]["NodeID"] for a in ranks} == {node}


def test_requests_succeed_on_both_replicas(three_node_app):
    url, router = three_node_app["url"], three_node_app["handle"]

    async def run():
        async with httpx.AsyncClient(timeout=httpx.Timeout(180.0)) as client:
            return await asyncio.gather(
                *(stream_completion(client, url, [10 + i, 20, 30, 40, 50], 12) for i in range(8))
            )

    results = asyncio.run(run())  # the tiny model's vocabulary is 512: prompts are token ids
    assert all(complete(r, 12) for r in results), [r["error"] or r["finish_reason"] for r in results]
    counts = router.routed_counts.remote().result()
    assert len([c for c in counts.values() if c > 0]) == 2, counts  # both replicas served
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": [7, 8, 9], "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
