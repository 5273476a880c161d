"""Workloads and arrival times are deterministic per seed, within their stated ranges."""

import json
import math

import pytest

from loadtest import workloads
from loadtest.arrivals import Burst, Constant, Poisson
from loadtest.tokens import TokenCounter, embedded_gguf_path, load_counter
from loadtest.workloads import WorkloadConfig, build, dumps

APPROX = TokenCounter(0.75)


@pytest.mark.parametrize("name", ["mixed", "uniform", "shared-prefix", "multi-turn", "long-prompt"])
def test_same_seed_same_bytes(name):
    cfg = WorkloadConfig(name=name, num_requests=12, seed=7, prefix_tokens=64, long_range=(200, 300))
    a, b = dumps(build(cfg, APPROX)), dumps(build(cfg, APPROX))
    assert a == b
    other = WorkloadConfig(name=name, num_requests=12, seed=8, prefix_tokens=64, long_range=(200, 300))
    assert dumps(build(other, APPROX)) != a
    assert len(a.splitlines()) == 12


def test_mixed_ranges_and_kinds():
    specs = build(WorkloadConfig("mixed", num_requests=200, seed=1), APPROX)
    assert all(20 - 12 <= s.prompt_tokens <= 600 for s in specs)  # cut at a word: just under target
    assert all(10 <= s.max_tokens <= 800 for s in specs)
    kinds = {s.kind for s in specs}
    assert kinds == {"short_qa", "translation", "code", "summary", "story", "analysis", "long_guide"}
    assert max(s.prompt_tokens for s in specs) > 400 and max(s.max_tokens for s in specs) > 600
    assert all(s.prompt and s.messages is None for s in specs)
    # forced output length override
    fixed = build(WorkloadConfig("mixed", num_requests=5, seed=1, output_tokens=33), APPROX)
    assert {s.max_tokens for s in fixed} == {33}


def test_uniform_ranges():
    """The engine benchmarks' shape: lengths drawn uniformly from the given ranges, plain text."""
    specs = build(WorkloadConfig("uniform", num_requests=300, seed=4), APPROX)  # default 20-600 / 10-500
    assert {s.kind for s in specs} == {"uniform"} and all(s.prompt and s.messages is None for s in specs)
    assert all(20 - 12 <= s.prompt_tokens <= 600 for s in specs)  # cut at a word: just under target
    assert all(10 <= s.max_tokens <= 500 for s in specs)
    assert 250 <= sum(s.prompt_tokens for s in specs) / len(specs) <= 350  # uniform: mean near 310
    assert 200 <= sum(s.max_tokens for s in specs) / len(specs) <= 310  # near 255
    narrow = build(
        WorkloadConfig("uniform", num_requests=20, seed=4, prompt_range=(50, 60), output_range=(7, 7)), APPROX
    )
    assert all(50 - 12 <= s.prompt_tokens <= 60 for s in narrow) and {s.max_tokens for s in narrow} == {7}


class _WordTokenizer:
    """A stand-in tokenizer: one id per word (what the approximate counter assumes at 1.0)."""

    def encode(self, text, add_special_tokens=True):
        return [sum(map(ord, w)) % 1000 for w in text.split()] + ([0] if add_special_tokens else [])


def test_token_ids_plain_and_exact_length():
    tok = _WordTokenizer()
    specs = build(WorkloadConfig("uniform", num_requests=10, seed=5, prompt_range=(30, 40)), TokenCounter(1.0))
    for s in specs:
        ids = workloads.token_ids(s, tok)
        assert len(ids) == s.prompt_tokens  # no special tokens; same count as the workload's
        assert workloads.token_ids(s, tok, 40) == (ids + ids)[:40]  # filled from the prompt's start
        assert workloads.token_ids(s, tok, 12) == ids[:12]  # or cut
    chat = build(WorkloadConfig("multi-turn", num_requests=2, seed=0, turns=1), TokenCounter(1.0))[0]
    assert len(workloads.token_ids(chat, tok)) == chat.prompt_tokens  # messages joined
    with pytest.raises(ValueError):
        workloads.token_ids(workloads.RequestSpec("e", 1, prompt=""), tok, 4)


def test_shared_prefix_has_one_common_prefix():
    specs = build(WorkloadConfig("shared-prefix", num_requests=6, seed=3, prefix_tokens=100), APPROX)
    prefix = specs[0].prompt.split("\n\n")[0]
    assert 90 <= APPROX.count(prefix) <= 100
    assert all(s.prompt.startswith(prefix + "\n\n") for s in specs)
    assert len({s.prompt for s in specs}) == 6


def test_multi_turn_resends_conversation():
    specs = build(WorkloadConfig("multi-turn", num_requests=6, seed=0, turns=3), APPROX)
    by_id = {s.id: s for s in specs}
    assert [s.id for s in specs[:2]] == ["chat-0-0", "chat-1-0"]  # all first turns first
    for s in specs:
        if s.depends_on:
            prev = by_id[s.depends_on]
            assert s.messages[: len(prev.messages)] == prev.messages
            assert s.messages[len(prev.messages)]["role"] == "assistant"
            assert s.prompt_tokens > prev.prompt_tokens


def test_jsonl_round_trip(tmp_path):
    specs = build(WorkloadConfig("multi-turn", num_requests=4, seed=0, turns=2), APPROX)
    p = tmp_path / "w.jsonl"
    p.write_text(dumps(specs) + json.dumps({"prompt": "hello there", "output_tokens": 5}) + "\n")
    back = build(WorkloadConfig("jsonl", path=str(p)), APPROX)
    assert dumps(back[:4]) == dumps(specs)
    assert (back[4].max_tokens, back[4].prompt_tokens, back[4].id) == (5, 3, "req-4")


def test_arrivals_deterministic():
    p = Poisson(4.0, seed=5).times(2000)
    assert p == Poisson(4.0, seed=5).times(2000) and p != Poisson(4.0, seed=6).times(2000)
    assert p[0] == 0 and all(b >= a for a, b in zip(p, p[1:]))
    assert p[-1] / 1999 == pytest.approx(0.25, rel=0.1)  # mean gap 1/rate
    assert Poisson(math.inf).times(3) == [0, 0, 0]
    assert Burst(3, 2.0).times(7) == [0, 0, 0, 2, 2, 2, 4]
    assert Constant(2.0).times(3) == [0, 0.5, 1.0]


@pytest.mark.skipif(embedded_gguf_path() is None, reason="embedded SmolLM2 GGUF not installed")
def test_real_tokenizer_lengths_and_determinism():
    counter = load_counter("smollm2")
    cfg = WorkloadConfig("mixed", num_requests=6, seed=2)
    a = build(cfg, counter)
    assert dumps(a) == dumps(build(cfg, counter))
    for s in a:
        assert s.prompt_tokens == counter.count(s.prompt)
        assert s.prompt_tokens <= 600
    # the random draws do not depend on the tokenizer: same kinds and output lengths
    b = build(cfg, APPROX)
    assert [(s.kind, s.max_tokens) for s in a] == [(s.kind, s.max_tokens) for s in b]
    # token ids for the engine benchmarks: as many as counted, or exactly the asked length
    u = build(WorkloadConfig("uniform", num_requests=6, seed=2, prompt_range=(64, 64)), counter)
    for s in u:
        assert 60 <= len(workloads.token_ids(s, counter.tokenizer)) == s.prompt_tokens <= 64
        assert len(workloads.token_ids(s, counter.tokenizer, 64)) == 64
