"""A tensor-parallel engine replica behind the router: one Serve replica, one placement group
(STRICT_PACK) of 3 bundles, 3 TPWorker ranks (SmolLM2: 9 heads, 3 KV heads); greedy output
equals the tp=1 app's."""

from __future__ import annotations

import httpx
import pytest

from tests.router.conftest import BASE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp3_url(serve_cluster):
    from ray import serve

    from router.app import build_app
    from router.config import AppConfig

    serve.run(build_app(AppConfig(**BASE, tensor_parallel_size=3)), name="tp3", route_prefix="/tp3")
    yield f"{serve_cluster['url']}/tp3"
    serve.delete("tp3")


def test_tp3_matches_tp1(tp3_url, base_url):
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    tp3 = httpx.post(f"{tp3_url}/v1/completions", json=body, timeout=300)
    tp1 = httpx.post(f"{base_url}/v1/completions", json=body, timeout=300)
    assert tp3.status_code == 200 and tp1.status_code == 200
    assert tp3.json()["choices"][0]["text"] == tp1.json()["choices"][0]["text"]
    health = httpx.get(f"{tp3_url}/health", timeout=60).json()
    assert health["status"] == "ok" and health["replicas"] == 1
