"""Per-request fault isolation (engine/core/step_faults.py): a step that raises because of one
request fails that request alone (error_kind "internal"), the others finish with the outputs
they would have had, every block returns; a step that fails whatever it runs still kills the
engine. Also the edge checks that keep known poison out: top_k past the vocabulary, stop token
ids outside it."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.core.step_faults import MAX_CULPRITS_IN_A_ROW
from engine.errors import InvalidRequestError
from engine.runner.sampling_metadata import SamplingMetadata
from tests.engine.test_kv_transfer import _assert_pools_whole

POISON_SEED = 4242  # the patched sampler build raises for a request with this seed
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Water boils at", "List three colors:"]


@pytest.fixture(scope="module")
def llm():
    llm = LLM(dtype="float32", num_threads=2, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    yield llm
    llm.shutdown()


def _poison_build(monkeypatch, when):
    """Patch the sampler's batch build (from the test, outside the engine) to raise when `when`
    holds for the batch's parameters."""
    original = SamplingMetadata.build.__func__

    def build(cls, params, *args, **kwargs):
        if when(params):
            raise ValueError("Overflow when unpacking long long")
        return original(cls, params, *args, **kwargs)

    monkeypatch.setattr(SamplingMetadata, "build", classmethod(build))


def test_a_request_that_breaks_its_step_fails_alone(llm, monkeypatch):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate(PROMPTS, greedy, use_tqdm=False)
    _poison_build(monkeypatch, lambda params: any(p.seed == POISON_SEED for p in params))
    poison = SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=12)
    # The poison arrives with the others: all are new in its first step, so all are suspects
    # until each has run a step alone.
    got = llm.generate(PROMPTS[:2] + ["hi"] + PROMPTS[2:], [greedy, greedy, poison, greedy, greedy], use_tqdm=False)
    bad = got.pop(2)
    assert bad.error is not None and "failed the engine step" in bad.error and bad.error_kind == "internal"
    assert bad.outputs[0].finish_reason == "error"
    for a, b in zip(got, expected):
        assert a.error is None and a.outputs[0].token_ids == b.outputs[0].token_ids
    stats = llm.stats()
    assert stats["num_request_faults"] == 1, stats
    _assert_pools_whole(llm)
    # And the engine goes on serving.
    assert llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


def test_a_poison_in_a_running_batch_fails_alone(llm, monkeypatch):
    """The poison breaks a later step (its 5th token), not its first: every request of that step
    is a suspect, each runs a step alone, and only the poison fails."""
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = llm.generate(PROMPTS, greedy, use_tqdm=False)
    _poison_build(
        monkeypatch,
        lambda params: any(p.seed == POISON_SEED for p in params) and _calls(5),
    )
    poison = SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=10, ignore_eos=True)
    got = llm.generate(PROMPTS + ["hi"], [greedy] * 4 + [poison], use_tqdm=False)
    bad = got.pop()
    assert bad.error_kind == "internal", bad.error
    for a, b in zip(got, expected):
        assert a.error is None and a.outputs[0].token_ids == b.outputs[0].token_ids
    _assert_pools_whole(llm)


_count = {"n": 0}


def _calls(after: int) -> bool:
    _count["n"] += 1
    return _count["n"] >= after


def test_a_step_that_always_fails_kills_the_engine():
    llm = LLM(dtype="float32", num_threads=2, max_model_len=128, kv_cache_memory_bytes=8 << 20)
    try:
        with pytest.MonkeyPatch.context() as mp:
            _poison_build(mp, lambda params: True)
            reqs = [llm.engine.add_request(None, p, SamplingParams(max_tokens=4)) for p in PROMPTS * 2]
            failed = 0
            with pytest.raises(ValueError, match="Overflow"):
                for _ in range(200):
                    for out in llm.engine.step():
                        failed += out.finished and out.error_kind == "internal"
            assert failed == MAX_CULPRITS_IN_A_ROW - 1, failed  # then the step itself is to blame
            assert reqs
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (dict(stop_token_ids=[49152]), "stop_token_ids"),
        (dict(stop_token_ids=[2**64]), "stop_token_ids"),
        (dict(stop_token_ids=list(range(300))), "stop_token_ids"),
        (dict(stop=["x" * 600]), "stop"),
        (dict(min_tokens=300, max_tokens=None), "min_tokens"),
    ],
)
def test_ids_and_sizes_past_the_model_are_refused_at_the_edge(llm, params, field):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate("hi", SamplingParams(**params), use_tqdm=False)
    assert e.value.param == field


def test_top_k_past_the_vocabulary_means_every_token(llm):
    """2**63 passes SamplingParams; the engine keeps it off the int64 tensor (top_k >= vocab
    keeps every token, which is what 0 means)."""
    a = llm.generate("hi", SamplingParams(top_k=2**63, seed=7, max_tokens=6), use_tqdm=False)[0]
    b = llm.generate("hi", SamplingParams(top_k=0, seed=7, max_tokens=6), use_tqdm=False)[0]
    assert a.error is None and a.outputs[0].token_ids == b.outputs[0].token_ids
