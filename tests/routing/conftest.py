"""One Ray cluster + Serve app with 3 engine replicas of the chat stand-in (tests/tiny_llama.py)
behind the cache-aware router, and a small KV cache per replica (22 blocks of 16 tokens) so that
traces evict."""

from __future__ import annotations

import pytest

from tests.router.conftest import BASE
from tests.serve_cluster import serve_app
from tests.tiny_llama import chat_stand_in_block_bytes

APP = "cache"


@pytest.fixture(scope="package")
def cache_cluster(chat_stand_in):
    small_kv = {**BASE, "model": chat_stand_in, "kv_cache_memory_bytes": 22 * chat_stand_in_block_bytes()}
    with serve_app(APP, **small_kv, num_replicas=3, routing="cache-aware", max_num_seqs=16) as cluster:
        yield cluster
