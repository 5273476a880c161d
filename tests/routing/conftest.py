"""One Ray cluster + Serve app with 3 engine replicas behind the cache-aware router, and a small
KV cache per replica (~22 blocks of 16 tokens) so that traces evict."""

from __future__ import annotations

import pytest

from tests.net import free_port, wait_healthy

APP = "cache"


@pytest.fixture(scope="package")
def cache_cluster():
    ray = pytest.importorskip("ray")
    from ray import serve

    from router.app import build_app
    from router.config import AppConfig

    port = free_port()
    ray.init(address="local", num_cpus=8, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cfg = AppConfig(
            dtype="float32",
            kv_cache_memory_bytes=16 << 20,
            num_threads=1,
            cpus_per_worker=1.0,
            num_replicas=3,
            routing="cache-aware",
            max_num_seqs=16,
        )
        handle = serve.run(build_app(cfg), name=APP, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        yield {"url": url, "handle": handle, "cfg": cfg}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
