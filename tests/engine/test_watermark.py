"""Green-list watermarking (engine/watermark.py): the green share is gamma, the sampler and the
detector agree on every green list, watermarked outputs score far above the threshold and plain
ones near zero, and a watermarked request gets the same tokens alone, batched, preempted and
with speculative decoding (the list depends only on the previous token). The engine serves the
chat stand-in (tests/tiny_llama.py): the embedded model's vocabulary on a 2-layer random Llama,
whose sampled tokens carry more entropy than SmolLM2's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.layers.watermark_mask import green_mask
from engine.watermark import Watermark, detect, is_green

WM = Watermark(key=123456789)
PROMPTS = ["Once upon a time", "The weather today", "My favourite recipe is", "In the year 2050,"]
THRESHOLD = 4.0  # z-score: p ~ 3e-5 for text without the watermark


def test_green_lists_hold_gamma_and_the_detector_sees_the_sampler_s_lists():
    prev = torch.tensor([0, 17, 49151, 17])
    keys = torch.tensor([WM.key, WM.key, WM.key, WM.key + 1])
    gammas = torch.tensor([0.5, 0.5, 0.25, 0.5], dtype=torch.float64)
    mask = green_mask(prev, keys, gammas, 49152)
    share = mask.float().mean(dim=1)
    assert torch.allclose(share, gammas.float(), atol=0.01), share
    assert not torch.equal(mask[1], mask[3])  # another key, another list
    tokens = list(range(0, 49152, 97))
    assert is_green([17] * len(tokens), tokens, WM) == mask[1, tokens].tolist()
    with pytest.raises(InvalidRequestError):
        Watermark(key=-1)
    with pytest.raises(InvalidRequestError):
        Watermark(key=1, gamma=1.0)


@pytest.fixture(scope="module")
def llm(chat_stand_in):
    llm = LLM(chat_stand_in, dtype="float32", num_threads=2, max_model_len=512, kv_cache_memory_bytes=32 << 20)
    yield llm
    llm.shutdown()


def _sampled(**kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=7, max_tokens=120, ignore_eos=True, **kw)


def test_watermarked_outputs_are_detected_and_plain_ones_are_not(llm):
    marked = llm.generate(PROMPTS, _sampled(watermark=WM), use_tqdm=False)
    plain = llm.generate(PROMPTS, _sampled(), use_tqdm=False)
    z_marked = [detect(o.outputs[0].token_ids, WM).z_score for o in marked]
    z_plain = [detect(o.outputs[0].token_ids, WM).z_score for o in plain]
    print(f"z watermarked {z_marked}, plain {z_plain}")
    assert min(z_marked) > THRESHOLD and max(z_plain) < THRESHOLD
    # Another key sees ordinary text.
    assert all(detect(o.outputs[0].token_ids, Watermark(key=99)).z_score < THRESHOLD for o in marked)


def test_the_watermark_keeps_a_request_s_tokens_batched_and_preempted(llm, chat_stand_in):
    params = dataclasses.replace(_sampled(watermark=WM), max_tokens=48)
    alone = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert batched == alone
    # 12 blocks of 16 hold one request's ~53 tokens but not all four at once: preemption.
    small = LLM(chat_stand_in, dtype="float32", num_threads=2, max_model_len=512, num_blocks=12, block_size=16)
    try:
        squeezed = [o.outputs[0].token_ids for o in small.generate(PROMPTS, params, use_tqdm=False)]
        assert small.stats()["num_preemptions"] > 0
    finally:
        small.shutdown()
    assert squeezed == alone


def test_the_watermark_under_speculative_decoding(llm, chat_stand_in):
    """Drafts (the stand-in's first layer) are verified against the watermarked distribution:
    greedy outputs equal the ones without drafts."""
    spec = LLM(
        chat_stand_in,
        dtype="float32",
        num_threads=2,
        max_model_len=512,
        kv_cache_memory_bytes=32 << 20,
        speculative_config={"method": "self", "draft_layers": 1, "num_speculative_tokens": 4, "adaptive": False},
    )
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the"
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, watermark=WM)
    try:
        got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert spec.stats()["spec_num_drafts"] > 0
    finally:
        spec.shutdown()
    assert got == llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert got != plain[0].outputs[0].token_ids  # the watermark moved greedy choices
