"""Speculative decoding with a draft model ("draft": another local model sharing the tokenizer;
"self": the target's first layers with shared weights, or its weights in int8) on the embedded
model in float32: greedy and seeded output identical to spec off (and to transformers), with
prefix-cache hits, preemption and aborts; both KV pools (target and draft) end empty and the
prefix cache holds no rejected token."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.spec_decode.draft_length import DraftLengthPolicy, StepCostModel
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_spec_decode import PROMPTS, _check_pool
from tests.tiny_llama import save_tiny_llama

# Whole engines or Ray clusters per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

KW = dict(dtype="float32", num_threads=2, max_model_len=512, kv_cache_memory_bytes=16 << 20)
PARAMS = [
    SamplingParams(temperature=0, max_tokens=32, logprobs=1),
    SamplingParams(temperature=0, max_tokens=32, stop=[" 17,"]),
    SamplingParams(temperature=0, max_tokens=32, n=2),
    SamplingParams(temperature=0, max_tokens=24, min_tokens=8, repetition_penalty=1.1),
    SamplingParams(temperature=0, max_tokens=32),
]


# A random 2-layer Llama (tests/tiny_llama.py) with SmolLM2's tokenizer files: the draft's shape.
DRAFT = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory, smollm_dir):
    return str(
        save_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), tokenizer_from=smollm_dir, vocab_size=49152, **DRAFT)
    )


@pytest.fixture(scope="module")
def reference():
    off = LLM(**KW)
    yield off.generate(PROMPTS, PARAMS, use_tqdm=False)
    off.shutdown()


def _specs(smollm_dir, tiny_draft_dir):
    always = {"num_speculative_tokens": 4, "adaptive": False}  # every proposal verified
    return {
        "target-as-draft": {"method": "draft", "model": str(smollm_dir), **always},
        "tiny-random-draft": {"method": "draft", "model": tiny_draft_dir, **always},
        "self-8-layers": {"method": "self", "draft_layers": 8, **always},
        "self-int8": {"method": "self", "draft_quantization": "int8", **always},
    }


def _draft_pool_empty(llm: LLM) -> None:
    dm = llm.engine.core.scheduler.drafting.draft_model
    dm.check_integrity()
    assert dm.num_blocks_used() == 0


@pytest.mark.parametrize("name", ["target-as-draft", "tiny-random-draft", "self-8-layers", "self-int8"])
def test_greedy_identical_with_prefix_hits(name, reference, smollm_dir, tiny_draft_dir):
    llm = LLM(speculative_config=_specs(smollm_dir, tiny_draft_dir)[name], **KW)
    try:
        for _ in range(2):  # the second round starts on prefix-cache hits
            got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            for a, b in zip(reference, got):
                for ca, cb in zip(a.outputs, b.outputs):
                    assert ca.token_ids == cb.token_ids and ca.finish_reason == cb.finish_reason, name
                    if ca.logprobs is not None:
                        for la, lb in zip(ca.logprobs, cb.logprobs):
                            assert la.token_id == lb.token_id and la.logprob == pytest.approx(lb.logprob, abs=1e-4)
        s = llm.stats()
        assert s["spec_num_draft_tokens"] > 0
        if name == "target-as-draft":  # the target's greedy tokens: accepted but where penalties
            # or min_tokens change the target's choice (the draft proposes plain argmax)
            assert s["spec_num_accepted_tokens"] >= 0.85 * s["spec_num_draft_tokens"]
        _check_pool(llm, got)
        _draft_pool_empty(llm)
    finally:
        llm.shutdown()
    if name == "target-as-draft":
        assert s["spec_mean_accepted_length"] > 4.0


def test_equals_transformers(hf_smollm, smollm_dir):
    llm = LLM(speculative_config={"method": "self", "draft_layers": 12, "num_speculative_tokens": 3}, **KW)
    try:
        prompts = [llm.tokenizer(p).input_ids for p in PROMPTS[:3]]
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=24))
        for p, out in zip(prompts, got):
            ref, _ = hf_greedy(hf_smollm, p, 24, None)
            assert out.outputs[0].token_ids == ref[: len(out.outputs[0].token_ids)]
            assert len(out.outputs[0].token_ids) == 24 or out.outputs[0].finish_reason == "stop"
    finally:
        llm.shutdown()


def test_preemption_abort_and_seeded_sampling(smollm_dir):
    spec = {"method": "self", "draft_layers": 8, "num_speculative_tokens": 3, "adaptive": False}
    prompts = PROMPTS * 3
    sp = SamplingParams(temperature=0, max_tokens=40)
    seeded = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=s) for s in range(4)]
    small = dict(KW, num_blocks=24, max_num_seqs=16)
    on = LLM(speculative_config=spec, **small)
    try:
        got = on.generate(prompts, sp, use_tqdm=False)
        assert on.stats()["num_preemptions"] > 0
        _check_pool(on, got)
        _draft_pool_empty(on)
        got_seeded = [o.outputs[0].token_ids for o in on.generate(PROMPTS[:4], seeded, use_tqdm=False)]
        # An abort mid-generation gives both pools' blocks back.
        eng = on.engine
        rid = eng.add_request(None, PROMPTS[0], SamplingParams(temperature=0, max_tokens=200))
        for _ in range(6):
            eng.step()
        assert on.engine.core.scheduler.drafting.draft_model.num_blocks_used() > 0
        eng.abort_request(rid)
        eng.step()
        _draft_pool_empty(on)
        assert on.stats()["blocks_used"] == 0
    finally:
        on.shutdown()
    off = LLM(**small)
    try:
        ref = off.generate(prompts, sp, use_tqdm=False)
        ref_seeded = [o.outputs[0].token_ids for o in off.generate(PROMPTS[:4], seeded, use_tqdm=False)]
    finally:
        off.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert got_seeded == ref_seeded


def test_draft_with_another_vocabulary_is_refused(tmp_path, smollm_dir):
    other = str(save_tiny_llama(tmp_path / "other-vocab", tokenizer_from=smollm_dir, vocab_size=1000, **DRAFT))
    with pytest.raises(InvalidRequestError, match="vocab"):
        LLM(speculative_config={"method": "draft", "model": other}, **KW)
    with pytest.raises(InvalidRequestError, match="model"):
        LLM(speculative_config={"method": "draft"}, **KW)


def test_draft_model_cost_drives_k_to_zero():
    """A draft step as dear as a target step never pays; a cheap one does at one row."""
    target = {(b, k): b * (1.0 + 0.05 * k) for b in (1, 2, 4) for k in range(5)}
    dear = DraftLengthPolicy(4, StepCostModel(target), draft_cost=StepCostModel(target))
    assert not dear.worth_trying(1) and dear.choose(1, [0.9], [4]) == [0]
    cheap = {(b, k): 0.05 * b * (1 + k) for b in (1, 2, 4) for k in range(5)}
    policy = DraftLengthPolicy(4, StepCostModel(target), draft_cost=StepCostModel(cheap))
    assert policy.worth_trying(1) and policy.choose(1, [0.9], [4]) == [4]
    assert policy.choose(1, [0.9], [4], catchup=[400]) == [0]  # a long prompt to catch up first
