"""The offline API on the real embedded model: seeds, stop strings, n, abort, errors, stats."""

from __future__ import annotations

import pytest

from engine import LLM, InvalidRequestError, PromptTooLongError, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", kv_cache_memory_bytes=128 << 20, num_threads=2, max_model_len=1024)


def test_seeded_sampling_same_alone_and_in_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234)
    alone = llm.generate("Once upon a time", sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [f"Random prompt number {i} about {w}" for i, w in enumerate(["cats", "code", "rain", "maths"] * 4)]
    mixed = [
        SamplingParams(temperature=0.7 + 0.05 * i, top_k=20, max_tokens=6 + i, seed=None if i % 2 else i)
        for i in range(16)
    ]
    batch = llm.generate(others[:8] + ["Once upon a time"] + others[8:], mixed[:8] + [sp] + mixed[8:], use_tqdm=False)
    assert batch[8].outputs[0].token_ids == alone
    again = llm.generate("Once upon a time", sp, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    different = (
        llm.generate(
            "Once upon a time", SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=99), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    assert different != alone


def test_stop_string_is_cut_and_frees_blocks(llm):
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=30, stop=["answer"]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "answer"
    assert "answer" not in out.text and out.text.startswith(" Paris")
    assert llm.stats()["blocks_used"] == 0


def test_stop_token_ids_and_ignore_eos(llm):
    base = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    stop_tok = base.outputs[0].token_ids[2]
    out = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == base.outputs[0].token_ids[:3] and out.stop_reason == stop_tok
    long = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0].outputs[
        0
    ]
    assert len(long.token_ids) == 40 and long.finish_reason == "length"


def test_n_samples_share_prompt_and_differ(llm):
    prompt = "Write a short poem about the sea and the wind and the ships that sail at night. " * 3
    hits = llm.stats()["prefix_cache_hits"]
    out = llm.generate(
        prompt, SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=7, ignore_eos=True), use_tqdm=False
    )[0]
    assert llm.stats()["prefix_cache_hits"] - hits >= 3 * 16  # later siblings reuse the prompt's full blocks
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert llm.stats()["blocks_used"] == 0


def test_abort_frees_every_block(llm):
    eng = llm.engine
    rid = eng.add_request(None, "Tell me a long story about dragons", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.stats()["blocks_used"] > 0
    eng.abort_request(rid)
    eng.step()
    assert eng.stats()["blocks_used"] == 0
    eng.core.scheduler.check_integrity()
    assert not eng.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(n=0), "n"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(logprobs=50), "logprobs"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_bad_sampling_values_raise_typed_errors(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


def test_bad_prompts(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate("", SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**9]}, SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(PromptTooLongError, match="maximum context length is 1024"):
        llm.generate({"prompt_token_ids": [5] * 1100}, SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(PromptTooLongError):
        llm.generate({"prompt_token_ids": [5] * 1000}, SamplingParams(max_tokens=100), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_chat_uses_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False
    )[0]
    assert "<|im_start|>assistant" in out.prompt
    assert "4" in out.outputs[0].text


def test_stats_report_kv_and_waste(llm):
    s = llm.stats()
    for key in ("blocks_used", "blocks_free", "blocks_cached", "prefix_hit_rate", "kv_waste", "num_preemptions"):
        assert key in s
    assert s["blocks_used"] + s["blocks_free"] == s["num_blocks"]


def test_n_siblings_share_prompt_blocks_with_prefix_caching_off():
    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 << 20, num_threads=2, enable_prefix_caching=False)
    prompt = "A list of the planets of the solar system, in order from the sun, with one fact each: " * 3
    out = llm.generate(
        prompt, SamplingParams(n=3, temperature=0.9, max_tokens=6, seed=3, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs) == 3
    assert llm.stats()["prefix_cache_hits"] >= 2 * 3 * 16  # two later siblings reuse >= 3 full blocks
    # ...but an unrelated later request with the same prompt does not hit (caching is off).
    hits = llm.stats()["prefix_cache_hits"]
    llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] == hits
