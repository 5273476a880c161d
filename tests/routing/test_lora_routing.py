"""Adapter-aware replica choice (router/replica_choice/cache_aware.py): with 3 replicas behind the
cache-aware router, requests of one LoRA adapter whose prompts share nothing all go to the replica
that holds the adapter (without the preference, misses spread over the replicas holding fewer
blocks); exact counts from the routing log."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.engine.lora_models import ADAPTERS, save_adapter, save_tiny_llama
from tests.router.conftest import BASE
from tests.serve_cluster import serve_app

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

N = 6


@pytest.fixture(scope="module")
def lora_app(tmp_path_factory, smollm_tokenizer):
    root = tmp_path_factory.mktemp("lora-routing")
    save_tiny_llama(root / "base", smollm_tokenizer)
    for i, name in enumerate(("qv", "all")):
        save_adapter(root / "base", root / name, seed=i + 1, **ADAPTERS[name])
    with serve_app(
        "lora-routing",
        "/lora-routing",
        **{**BASE, "model": str(root / "base"), "kv_cache_memory_bytes": 16 << 20},
        num_replicas=3,
        routing="cache-aware",
        enable_lora=True,
        max_lora_rank=8,
        lora_modules={name: str(root / name) for name in ("qv", "all")},
    ) as app:
        yield app


def test_requests_of_an_adapter_go_where_it_is(lora_app):
    handle, rng = lora_app["handle"], random.Random(0)
    words = ["alpha", "river", "stone", "cloud", "maple", "ember", "quartz", "harbor", "violet", "falcon"]
    ids: dict[str, list[str]] = {"qv": [], "all": []}
    with httpx.Client(base_url=lora_app["url"], timeout=120) as c:
        for name in ids:
            for i in range(N):
                prompt = f"{name} {i} " + " ".join(rng.choice(words) for _ in range(40))
                r = c.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 2, "temperature": 0})
                assert r.status_code == 200, r.text
                ids[name].append(r.json()["id"])
    decisions = handle.routing_decisions.remote().result()
    for name, rids in ids.items():
        counts: dict[str, int] = {}
        for rid in rids:
            d = decisions[f"{rid}-0"]
            assert d["predicted_cached_tokens"] == 0  # no prefix in common: only the adapter decides
            counts[d["replica"]] = counts.get(d["replica"], 0) + 1
        assert list(counts.values()) == [N], (name, counts)
