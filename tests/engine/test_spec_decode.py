"""Speculative decoding (n-gram) on the embedded model in float32: output identical to spec
off (greedy and seeded), every KV block back in the pool, no rejected token in the prefix
cache, and the verification rule sampling the target distribution."""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.block_hash import extend_block_hashes
from engine.layers.sampler import Sampler
from engine.runner.sampling_metadata import SamplingMetadata
from engine.spec_decode.draft_length import DraftLengthPolicy, StepCostModel
from engine.spec_decode.ngram_proposer import NgramProposer
from engine.spec_decode.verify import accept_drafts

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

PROMPTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog. the",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "Write a short poem about the sea.",
    "The capital of France is",
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}  # always draft


def _llm(**kw) -> LLM:
    return LLM(dtype="float32", num_threads=2, max_model_len=512, **kw)


@pytest.fixture(scope="module")
def off():
    return _llm(kv_cache_memory_bytes=32 << 20)


@pytest.fixture(scope="module")
def on():
    return _llm(kv_cache_memory_bytes=32 << 20, speculative_config=SPEC)


def _check_pool(llm: LLM, outputs) -> None:
    """Every block is free, and every hash in the prefix cache is one of a full block of a
    prompt + accepted output (a rejected draft would give a hash no sequence has)."""
    sched = llm.engine.core.scheduler
    sched.check_integrity()
    assert sched.kv_cache_manager.block_pool.get_num_used_blocks() == 0
    bs = sched.block_size
    valid = set()
    for out in outputs:
        for c in out.outputs:
            tokens = list(out.prompt_token_ids) + list(c.token_ids)
            for salt in (None, f"n:{out.request_id}"):
                valid.update(extend_block_hashes([], tokens, bs, salt))
    cached = set(sched.kv_cache_manager.block_pool.cached_block_hash_to_block)
    assert cached and cached <= valid


def test_greedy_identical_with_stops_logprobs_and_n(off, on):
    params = [
        SamplingParams(temperature=0, max_tokens=40, logprobs=2),
        SamplingParams(temperature=0, max_tokens=40, stop=[" 17,"]),
        SamplingParams(temperature=0, max_tokens=40, n=2, stop_token_ids=[1]),
        SamplingParams(temperature=0, max_tokens=24, min_tokens=8, repetition_penalty=1.1),
        SamplingParams(temperature=0, max_tokens=30, presence_penalty=0.5),
    ]
    ref = off.generate(PROMPTS, params, use_tqdm=False)
    for _ in range(2):  # the second round runs on prefix-cache hits
        got = on.generate(PROMPTS, params, use_tqdm=False)
        for a, b in zip(ref, got):
            for ca, cb in zip(a.outputs, b.outputs):
                assert ca.text == cb.text and ca.finish_reason == cb.finish_reason
                # Also where a stop string ends it mid-step: the ids stop at the matching token.
                assert ca.token_ids == cb.token_ids and ca.stop_reason == cb.stop_reason
                if ca.logprobs is not None:
                    assert len(cb.logprobs) == len(cb.token_ids)
                    for la, lb in zip(ca.logprobs, cb.logprobs):
                        assert la.token_id == lb.token_id and la.logprob == pytest.approx(lb.logprob, abs=1e-4)
    assert "17" not in got[1].outputs[0].text
    s = on.stats()
    # Drafts were both accepted and rejected.
    assert 0 < s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"]
    assert s["spec_mean_accepted_length"] > 1.5
    _check_pool(on, got)


@pytest.mark.slow
def test_preemption_small_pool_identical():
    prompts = PROMPTS * 3
    sp = SamplingParams(temperature=0, max_tokens=48)
    small = _llm(num_blocks=24, speculative_config=SPEC, max_num_seqs=16)
    got = small.generate(prompts, sp, use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    _check_pool(small, got)
    del small
    ref = _llm(num_blocks=24, max_num_seqs=16).generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


def test_seeded_sampling_same_as_spec_off_and_in_any_batch(off, on):
    sps = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=s) for s in range(6)]
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    ref = [o.outputs[0].token_ids for o in off.generate(prompts, sps, use_tqdm=False)]
    batch = [o.outputs[0].token_ids for o in on.generate(prompts, sps, use_tqdm=False)]
    alone = on.generate(prompts[4], sps[4], use_tqdm=False)[0].outputs[0].token_ids
    assert batch == ref and alone == ref[4]


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.999 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("draft", [0, 3])
def test_verification_follows_target_distribution(draft):
    """The sampler + accept_drafts on a known p with a point-mass draft: the emitted token is
    distributed as p and the draft is accepted with probability p(draft)."""
    torch.manual_seed(0)
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    n = 20000
    logits = torch.log(p).repeat(n, 1)
    sp = SamplingParams(temperature=1.0)
    md = SamplingMetadata.build([sp] * n, [[0]] * n, [[]] * n)
    tokens = Sampler()(logits, md).sampled_token_ids.tolist()
    counts = torch.zeros(6)
    accepted = 0
    for i in range(n):
        emitted, _ = accept_drafts([draft], tokens, [None] * n, i)
        accepted += len(emitted) - 1
        counts[emitted[0]] += 1
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < _chi2_critical(len(p) - 1)
    rate = accepted / n
    assert abs(rate - float(p[draft])) < 4 * math.sqrt(float(p[draft]) * (1 - float(p[draft])) / n)


def test_ngram_proposer_latest_longest_match():
    prop = NgramProposer(2, 4)
    assert prop.propose("r", [1, 2, 3, 4, 1, 2, 3, 7, 1, 2, 3], 3) == [7, 1, 2]
    assert prop.propose("r", [1, 2, 3, 4, 1, 2, 3, 7, 1, 2, 3, 9], 3) == []  # no match of [3, 9]
    assert prop.propose("s", [5, 6, 7], 3) == []


def test_draft_length_goes_to_zero_when_compute_bound():
    # Memory-bound at 1 row (4 tokens cost ~1.25x one), compute-bound at 64 rows (cost per token).
    table = {(1, k): 1.0 + 0.08 * k for k in range(5)} | {(64, k): 64.0 * (1 + k) for k in range(5)}
    policy = DraftLengthPolicy(4, StepCostModel(table))
    assert policy.choose(1, [0.8], [4]) == [4]
    assert policy.choose(1, [0.05], [4]) == [0]  # drafts that are never accepted do not pay
    assert not policy.worth_trying(64) and policy.choose(64, [0.9] * 64, [4] * 64) == [0] * 64
    assert policy.choose(1, [0.8], [4], prefill=500) == [0]  # a prompt-heavy step is compute-bound
