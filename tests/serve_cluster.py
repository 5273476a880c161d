"""A local Ray cluster with Serve on a loopback port, for the end-to-end test packages: started
without the dashboard, and Serve and Ray shut down when the block ends, whatever happened."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from tests.net import free_port, wait_healthy

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from router.config import AppConfig


@contextmanager
def local_serve(num_cpus: int = 8) -> Iterator[str]:
    """Yields the base URL Serve's proxy listens on."""
    import ray
    from ray import serve

    if ray.is_initialized():  # a test module before this one left its own (it should not)
        ray.shutdown()
    port = free_port()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def run_app(cfg: AppConfig, name: str, url: str, route_prefix: str = "/") -> DeploymentHandle:
    """Deploys Orbital's app with `cfg` and waits until its /health says ok."""
    from ray import serve

    from router.app import build_app

    handle = serve.run(build_app(cfg), name=name, route_prefix=route_prefix)
    wait_healthy(url + route_prefix.rstrip("/"))
    return handle


@contextmanager
def serve_app(name: str, num_cpus: int = 8, **config) -> Iterator[dict]:
    """`local_serve` with one Orbital app of `AppConfig(**config)` deployed and healthy: yields
    {"url", "handle", "cfg"}; everything is shut down when the block ends."""
    import pytest

    pytest.importorskip("ray")
    from router.config import AppConfig

    with local_serve(num_cpus) as url:
        cfg = AppConfig(**config)
        yield {"url": url, "handle": run_app(cfg, name, url), "cfg": cfg}


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
