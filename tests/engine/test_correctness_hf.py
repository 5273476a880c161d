"""Greedy token ids equal transformers' in float32, for every engine feature combination."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy, hf_prompt_logprobs

NEW = 20
LONG = ("The history of the city begins with a small settlement on the river bank. " * 30).strip()
PROMPTS = [
    "Hello",
    "The capital of France is",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "Écris une phrase en français sur les élèves et l'été: ",
    "東京は日本の首都です。大阪は",
    "Emoji test 🚀🌍 and symbols ∑∫√ — then a list:\n1.",
    LONG,
    "<|im_start|>user\nWhat is 17 * 3?<|im_end|>\n<|im_start|>assistant\n",
    "SELECT name, COUNT(*) FROM users GROUP BY",
    "1, 2, 3, 5, 8, 13,",
]


@pytest.fixture(scope="module")
def reference(hf_smollm, smollm_tokenizer):
    eos = smollm_tokenizer.eos_token_id
    ids = [smollm_tokenizer(p).input_ids for p in PROMPTS]
    return ids, [hf_greedy(hf_smollm, x, NEW, eos) for x in ids]


def _check(llm: LLM, reference, logprob_tol: float | None = None):
    ids, expected = reference
    outs = llm.generate(
        [{"prompt_token_ids": x} for x in ids],
        SamplingParams(temperature=0, max_tokens=NEW, logprobs=0 if logprob_tol else None),
        use_tqdm=False,
    )
    for out, (exp_ids, exp_lps), prompt in zip(outs, expected, PROMPTS):
        got = out.outputs[0].token_ids
        assert got == exp_ids, f"prompt {prompt[:30]!r}: {got} != {exp_ids}"
        if logprob_tol:
            lps = [lp.logprob for lp in out.outputs[0].logprobs]
            assert max(abs(a - b) for a, b in zip(lps, exp_lps)) < logprob_tol
    llm.engine.core.scheduler.check_integrity()
    assert llm.stats()["blocks_used"] == 0


@pytest.mark.slow
def test_greedy_and_logprobs_match_transformers(reference):
    llm = LLM(dtype="float32", kv_cache_memory_bytes=256 << 20, num_threads=2)
    assert len(reference[0][6]) > 300  # the long prompt spans several chunks below
    _check(llm, reference, logprob_tol=1e-3)


@pytest.mark.slow
def test_chunked_prefill_tiny_budget(reference):
    llm = LLM(dtype="float32", kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=32, num_threads=2)
    _check(llm, reference)


@pytest.mark.slow
def test_preemption_with_tiny_pool(reference):
    # 40 blocks of 16 = 640 slots for 10 prompts (~600 tokens of prompts + 200 outputs): must preempt.
    llm = LLM(dtype="float32", num_blocks=40, block_size=16, max_num_batched_tokens=512, num_threads=2)
    _check(llm, reference)
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.slow
def test_prefix_cache_shared_prefix(hf_smollm, smollm_tokenizer):
    system = "You are a careful assistant. Answer briefly and precisely. " * 8
    prompts = [system + q for q in ("Why is the sky blue?", "Name a prime number.", "What is rust?")]
    ids = [smollm_tokenizer(p).input_ids for p in prompts]
    eos = smollm_tokenizer.eos_token_id
    expected = [hf_greedy(hf_smollm, x, 12, eos)[0] for x in ids]
    llm = LLM(dtype="float32", kv_cache_memory_bytes=128 << 20, enable_prefix_caching=True, num_threads=2)
    params = SamplingParams(temperature=0, max_tokens=12)
    first = llm.generate({"prompt_token_ids": ids[0]}, params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": x} for x in ids[1:]], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in first + rest]
    assert got == expected
    stats = llm.stats()
    assert stats["prefix_cache_hits"] >= 2 * 16 * 4  # both later prompts reuse >= 4 full blocks
    assert rest[0].num_cached_tokens > 0
    llm.engine.core.scheduler.check_integrity()


@pytest.mark.slow
def test_prompt_logprobs_match_transformers(hf_smollm, smollm_tokenizer):
    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=16, num_threads=2)
    ids = smollm_tokenizer("The quick brown fox jumps over the lazy dog because it wants to eat.").input_ids
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    got = out.prompt_logprobs
    assert got[0] is None and len(got) == len(ids)
    exp = hf_prompt_logprobs(hf_smollm, ids)
    assert max(abs(g.logprob - e) for g, e in zip(got[1:], exp)) < 1e-3
    assert all(len(g.top) == 2 for g in got[1:])
