"""Local Ray clusters with Serve on a loopback port, for the end-to-end test packages, started
without the dashboard. Most packages deploy their apps onto one shared cluster (started once
per run, shut down at its end by tests/conftest.py): starting Ray and Serve costs ~15 s here.
A test that needs a cluster of its own shape (fewer CPUs, several nodes) stops the shared one
first (`release_ray`); the next package that needs it starts it again."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from tests.net import free_port, wait_healthy

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from router.config import AppConfig

SHARED_CPUS = 8  # logical: every app of a package at once (2 cores really run them)
_shared: dict[str, str] = {}  # "ray" once the shared cluster runs, "url" once its Serve does


def release_ray() -> None:
    """Shut down whatever Ray this process runs (the shared cluster or another's), Serve first."""
    import ray
    from ray import serve

    _shared.clear()
    if ray.is_initialized():
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@contextmanager
def simulated_nodes(head_cpus: int, nodes: list[dict]) -> Iterator[tuple[object, list]]:
    """A multi-node cluster on this machine (ray.cluster_utils.Cluster): a head with `head_cpus`
    and one node per entry of `nodes` (add_node's arguments), this process connected to it.
    Yields (cluster, nodes); shut down when the block ends. The shared cluster stops first."""
    import ray
    from ray.cluster_utils import Cluster

    release_ray()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "include_dashboard": False})
    try:
        added = [cluster.add_node(**node) for node in nodes]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster, added
    finally:
        ray.shutdown()
        cluster.shutdown()


def _start_ray(num_cpus: int) -> None:
    import ray

    release_ray()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=False)


def _start_serve() -> str:
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def shared_ray() -> None:
    """The shared cluster's Ray (without Serve until a test asks for it), started if none runs."""
    import ray

    if not (_shared and ray.is_initialized()):
        _start_ray(SHARED_CPUS)
        _shared["ray"] = "up"


def shared_serve() -> str:
    """The base URL of the shared cluster's Serve proxy, starting the cluster if none runs."""
    shared_ray()
    if "url" not in _shared:
        _shared["url"] = _start_serve()
    return _shared["url"]


@contextmanager
def local_serve(num_cpus: int) -> Iterator[str]:
    """A cluster of this test's own (the shared one is stopped first): yields the base URL of
    Serve's proxy; Serve and Ray are shut down when the block ends, whatever happened."""
    _start_ray(num_cpus)
    try:
        yield _start_serve()
    finally:
        release_ray()


def run_app(cfg: AppConfig, name: str, url: str, route_prefix: str = "/") -> DeploymentHandle:
    """Deploys Orbital's app with `cfg` and waits until its /health says ok."""
    from ray import serve

    from router.app import build_app

    handle = serve.run(build_app(cfg), name=name, route_prefix=route_prefix)
    wait_healthy(url + route_prefix.rstrip("/"))
    return handle


@contextmanager
def serve_app(name: str, route_prefix: str = "/", **config) -> Iterator[dict]:
    """One Orbital app of `AppConfig(**config)` deployed on the shared cluster and healthy:
    yields {"url", "handle", "cfg"} ("url" is the app's own); the app is deleted when the block
    ends."""
    import pytest

    pytest.importorskip("ray")
    from ray import serve

    from router.config import AppConfig

    url = shared_serve()
    cfg = AppConfig(**config)
    try:
        handle = run_app(cfg, name, url, route_prefix)
        yield {"url": url + route_prefix.rstrip("/"), "handle": handle, "cfg": cfg}
    finally:
        serve.delete(name)


def assert_completions_equal(url: str, prompts: list[str], texts: list[str], max_tokens: int) -> None:
    """Greedy /v1/completions for each prompt, plain and streamed, answer exactly `texts`."""
    import json

    import httpx

    with httpx.Client(base_url=url, timeout=120) as c:
        for prompt, want in zip(prompts, texts):
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                chunks = [
                    json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"
                ]
            assert "".join(x["choices"][0]["text"] for x in chunks if x["choices"]) == want
