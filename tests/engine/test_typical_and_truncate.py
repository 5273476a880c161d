"""typical_p (locally typical sampling) against transformers' TypicalLogitsWarper on the same
logits, batched with other settings per row; truncate_prompt_tokens keeps the last N prompt
tokens (what runs, what the output reports, and the same greedy text as that suffix alone)."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import TypicalLogitsWarper

from engine import LLM, SamplingParams
from engine.layers.sampler import apply_typical_p


def test_typical_p_keeps_what_transformers_keeps():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=g) * torch.tensor([0.5, 1, 2, 4, 8, 1.0]).unsqueeze(1)
    masses = [0.2, 0.5, 0.9, 0.95, 0.3, 1.0]
    got = logits.clone()
    apply_typical_p(got, torch.tensor(masses))
    for i, mass in enumerate(masses):
        if mass == 1.0:
            assert torch.equal(got[i], logits[i])  # off: untouched
            continue
        want = TypicalLogitsWarper(mass)(None, logits[i : i + 1].clone())[0]
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), (i, mass)
        kept = ~torch.isinf(got[i])
        assert 1 <= kept.sum() < 500 and torch.equal(got[i][kept], logits[i][kept])


def test_typical_p_changes_seeded_samples_and_is_refused_out_of_range():
    llm = LLM(dtype="float32", num_threads=2, max_model_len=128, kv_cache_memory_bytes=8 << 20)
    try:
        base = dict(temperature=1.5, seed=11, max_tokens=24, ignore_eos=True)
        plain = llm.generate("Once upon a time", SamplingParams(**base), use_tqdm=False)[0].outputs[0].token_ids
        typical = llm.generate("Once upon a time", SamplingParams(typical_p=0.2, **base), use_tqdm=False)
        assert typical[0].outputs[0].token_ids != plain
        for bad in (0.0, 1.5, float("nan")):
            try:
                SamplingParams(typical_p=bad)
            except ValueError as e:
                assert "typical_p" in str(e)
            else:
                raise AssertionError(bad)
    finally:
        llm.shutdown()


def test_truncate_prompt_tokens_runs_the_last_n():
    llm = LLM(dtype="float32", num_threads=2, max_model_len=128, kv_cache_memory_bytes=8 << 20)
    try:
        text = "The lighthouse keeper wrote about ships, storms and the long winter nights. " * 3
        ids = llm.engine.tokenizer(text).input_ids
        params = SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=10)
        cut = llm.generate(text, params, use_tqdm=False)[0]
        assert cut.prompt_token_ids == ids[-10:] and cut.prompt is None
        alone = llm.generate({"prompt_token_ids": ids[-10:]}, SamplingParams(temperature=0, max_tokens=8))[0]
        assert cut.outputs[0].token_ids == alone.outputs[0].token_ids
        # A prompt past the context fits once truncated.
        long = {"prompt_token_ids": (ids * 4)[:200]}
        out = llm.generate(long, SamplingParams(max_tokens=4, truncate_prompt_tokens=64), use_tqdm=False)[0]
        assert out.error is None and len(out.prompt_token_ids) == 64
    finally:
        llm.shutdown()
