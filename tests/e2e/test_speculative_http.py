"""Speculative decoding through HTTP: an app served with a self-drafting speculative config
(the target's first 8 layers as draft) answers greedy completions, streamed and not, with the
offline engine's exact text, and /metrics counts its drafts."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.router.conftest import BASE, metrics
from tests.serve_cluster import assert_completions_equal, serve_app

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5, 6, 7, 8,"]


@pytest.fixture(scope="module")
def spec_url():
    """One app, one engine replica, on the shared cluster (deleted after)."""
    spec = {"method": "self", "draft_layers": 8, "num_speculative_tokens": 3, "adaptive": False}
    with serve_app("spec", **BASE, num_replicas=1, speculative=spec) as cluster:
        yield cluster["url"]


@pytest.fixture(scope="module")
def offline_llm():
    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 << 20, num_threads=1)
    yield llm
    llm.shutdown()


def test_greedy_text_equals_offline_and_metrics_count_drafts(spec_url, offline_llm):
    want = offline_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    assert_completions_equal(spec_url, PROMPTS, [w.outputs[0].text for w in want], 32)
    m = metrics(spec_url)
    assert m["orbital:spec_decode_num_draft_tokens_total"] > 0
    assert m["orbital:spec_decode_num_accepted_tokens_total"] > 0
