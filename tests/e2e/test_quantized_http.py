"""Quantized weights and the int8 KV cache through HTTP: an app served with int8 weights and
kv_cache_dtype=int8 answers greedy completions (streamed and not, and through the `openai`
client) with the offline engine's exact text for the same settings, /metrics reports the KV
capacity in tokens (about 3.9x the float32 pool's at the same bytes), and every block returns."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.router.conftest import BASE, metrics
from tests.serve_cluster import assert_completions_equal, serve_app

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
QUANT = dict(quantization="int8", kv_cache_dtype="int8")


@pytest.fixture(scope="module")
def quant_url():
    with serve_app("quant", **BASE, num_replicas=1, **QUANT) as cluster:
        yield cluster["url"]


def test_greedy_text_equals_offline_and_metrics_report_kv_tokens(quant_url):
    offline = LLM(dtype="float32", kv_cache_memory_bytes=BASE["kv_cache_memory_bytes"], num_threads=1, **QUANT)
    try:
        want = offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
        capacity = offline.stats()["kv_capacity_tokens"]
    finally:
        offline.shutdown()
    assert_completions_equal(quant_url, PROMPTS, [w.outputs[0].text for w in want], 24)
    from openai import OpenAI

    client = OpenAI(base_url=f"{quant_url}/v1", api_key="unused")
    out = client.completions.create(
        model=client.models.list().data[0].id, prompt=PROMPTS[0], max_tokens=24, temperature=0
    )
    assert out.choices[0].text == want[0].outputs[0].text
    m = metrics(quant_url)
    # 64 MiB of int8 KV: SmolLM2's 30 layers x 3 KV heads x (64 + 2) bytes x 2 per token
    assert m["orbital:kv_cache_capacity_tokens"] == capacity >= 3.8 * (64 << 20) // (30 * 3 * 64 * 4 * 2)
    assert m["orbital:kv_cache_usage_perc"] == 0.0
