"""Decode CUDA graphs keep the correctness contract: greedy ids with graphs = eager = transformers
on CUDA in float32, across buckets as the batch shrinks, under preemption and chunked prefill
(mixed steps run eagerly), and seeded sampling the same with and without graphs."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_gpu_engine import NEW, PROMPTS, hf_model, reference  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# 24 prompts stopping after 1..20 new tokens: decode batches shrink ~22 -> 1 through buckets 32..1.
SHRINK = [list(range(50 + 7 * i, 50 + 7 * i + 5 + 13 * i)) for i in range(24)]
SHRINK_NEW = [1 + i * (NEW - 1) // 23 for i in range(24)]


def _llm(path, **kw):
    kw.setdefault("kv_cache_memory_bytes", 256 << 20)
    return LLM(str(path), dtype="float32", device="cuda", **kw)


def _graphs(llm):
    return llm.engine.core.executor.runner.graphs


def _greedy(llm, prompts, news):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in news]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.core.scheduler.check_integrity()
    assert llm.stats()["blocks_used"] == 0
    return [o.outputs[0].token_ids for o in outs]


def test_graphs_equal_eager_equal_transformers_across_buckets(hf_model):
    path, model = hf_model
    expected = [hf_greedy(model, p, n, None)[0] for p, n in zip(SHRINK, SHRINK_NEW)]
    llm = _llm(path, max_num_seqs=64)
    assert _graphs(llm).buckets == [1, 2, 4, 8, 16, 32, 64]
    got = _greedy(llm, SHRINK, SHRINK_NEW)
    used = _graphs(llm).replays
    eager = _llm(path, max_num_seqs=64, enforce_eager=True)
    assert _graphs(eager) is None
    got_eager = _greedy(eager, SHRINK, SHRINK_NEW)
    for i, (g, e, x) in enumerate(zip(got, got_eager, expected)):
        assert g == x, f"graphs, prompt {i}"
        assert e == x, f"eager, prompt {i}"
    assert len(used) >= 5 and {1, 2, 32} <= set(used), used


def test_graphs_under_preemption(hf_model, reference):
    llm = _llm(hf_model[0], num_blocks=60, block_size=16, max_num_batched_tokens=512)
    assert _greedy(llm, PROMPTS, [NEW] * len(PROMPTS)) == [ids for ids, _ in reference]
    assert llm.stats()["num_preemptions"] > 0 and sum(_graphs(llm).replays.values()) > 0


def test_graphs_with_chunked_prefill_mixed_steps(hf_model, reference):
    llm = _llm(hf_model[0], max_num_batched_tokens=32)
    assert _greedy(llm, PROMPTS, [NEW] * len(PROMPTS)) == [ids for ids, _ in reference]
    assert sum(_graphs(llm).replays.values()) > 0


def test_seeded_sampling_same_with_graphs_and_eager(hf_model):
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=77, ignore_eos=True)
    others = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    runs = []
    for eager in (False, True):
        llm = _llm(hf_model[0], enforce_eager=eager)
        alone = llm.generate({"prompt_token_ids": PROMPTS[1]}, seeded, use_tqdm=False)[0].outputs[0].token_ids
        batch = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            [seeded if i == 1 else others for i in range(len(PROMPTS))],
            use_tqdm=False,
        )
        assert batch[1].outputs[0].token_ids == alone
        assert (_graphs(llm) is None) == eager
        runs.append(alone)
    assert runs[0] == runs[1]


def test_reference_backend_runs_eagerly(hf_model, reference, monkeypatch):
    # Its decode buckets change shape every step: no graphs, same outputs.
    monkeypatch.setenv("ORBITAL_ATTENTION_BACKEND", "reference")
    llm = _llm(hf_model[0])
    assert _graphs(llm) is None
    assert _greedy(llm, PROMPTS[:3], [NEW] * 3) == [ids for ids, _ in reference[:3]]
