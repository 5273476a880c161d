"""One Ray cluster + Serve app with 3 engine replicas behind the cache-aware router, and a small
KV cache per replica (~22 blocks of 16 tokens) so that traces evict."""

from __future__ import annotations

import pytest

from tests.serve_cluster import serve_app

APP = "cache"


@pytest.fixture(scope="package")
def cache_cluster():
    with serve_app(
        APP,
        dtype="float32",
        kv_cache_memory_bytes=16 << 20,
        num_threads=1,
        cpus_per_worker=1.0,
        num_replicas=3,
        routing="cache-aware",
        max_num_seqs=16,
    ) as cluster:
        yield cluster
