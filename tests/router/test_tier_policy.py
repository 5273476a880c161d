"""The tier policy (router/tiering/): what it reads of a request, the hint header, the rules, the
learned classifier and its CLI, the config's checks, and the ingress's pool choice with its
decision and overflow counts (fake pools: no Ray)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from router.config import AppConfig
from router.tiering.classifier import TierClassifier, accuracy, train
from router.tiering.features import RequestFeatures, request_features
from router.tiering.policy import HINT_HEADER, TierHintError, TierPolicy
from router.tiering.settings import TierRouting
from tests.router.test_model_pools_config import _FakeOpenAI, _moved

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow


def words(s: str) -> int:
    return len(s.split())


def test_features_read_prompt_budget_tools_and_formats():
    chat = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "two words"}, {"type": "image_url"}]},
        ],
        "max_completion_tokens": 7,
        "max_tokens": 99,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "response_format": {"type": "json_object"},
    }
    f = request_features(chat, words)
    assert f == RequestFeatures("be brief\ntwo words", 4, 7, True, True)
    f = request_features({"prompt": [5, 6, 7], "max_tokens": 3, "response_format": {"type": "text"}}, words)
    assert (f.prompt_tokens, f.max_tokens, f.has_tools, f.has_response_format) == (3, 3, False, False)
    f = request_features({"prompt": "a b c", "tools": [{}], "tool_choice": "none", "guided_regex": "x+"}, words)
    assert (f.prompt_tokens, f.max_tokens, f.has_tools, f.has_response_format) == (3, None, False, True)
    assert request_features({"prompt": ["a b", "c"]}, words).prompt_tokens == 3


def _policy(**routing) -> TierPolicy:
    return TierPolicy("auto", ["small", "medium", "large"], TierRouting(**routing))


def _f(tokens=10, max_tokens=None, tools=False, fmt=False, text="") -> RequestFeatures:
    return RequestFeatures(text, tokens, max_tokens, tools, fmt)


def test_rules_first_match_hint_and_default():
    p = _policy(
        rules=[
            {"pool": "large", "tools": True},
            {"pool": "medium", "response_format": True, "max_prompt_tokens": 100},
            {"pool": "large", "min_prompt_tokens": 1000},
            {"pool": "medium", "min_max_tokens": 500},
        ]
    )
    assert p.decide(_f(tools=True, fmt=True), None).start == 2
    assert p.decide(_f(fmt=True), None) == p.decide(_f(50, fmt=True), None) and p.decide(_f(fmt=True), None).start == 1
    assert p.decide(_f(200, 20, fmt=True), None).reason == "default"  # 200 > 100 tokens: rule 2 fails
    assert p.decide(_f(5000), None).start == 2
    assert p.decide(_f(max_tokens=600), None).start == 1
    assert p.decide(_f(max_tokens=None), None).start == 1  # no budget: as long as the context
    assert p.decide(_f(max_tokens=20), None).start == 0
    # The hint comes first; it must name a pool of the tier.
    assert p.decide(_f(tools=True), "small").start == 0 and p.decide(_f(), "medium").reason == "hint"
    with pytest.raises(TierHintError):
        p.decide(_f(), "huge")
    with pytest.raises(TierHintError):
        _policy(allow_hint=False).decide(_f(), "small")


def test_config_checks_the_tier_routing():
    pools = [{"name": "small"}, {"name": "large"}]
    ok = AppConfig(models=pools, aliases={"auto": ["small", "large"]}, tier_routing={"auto": {"rules": []}})
    assert all("tier_routing" not in p.model_dump(exclude_defaults=True) for p in ok.pool_configs())
    cheap = AppConfig(models=[{"name": "small", "quantization": "int4:g32"}, {"name": "large"}])
    assert [p.quantization for p in cheap.pool_configs()] == ["int4:g32", None]
    with pytest.raises(ValueError, match="quantization"):
        AppConfig(models=[{"name": "small", "quantization": "int3"}])
    with pytest.raises(ValueError, match="not an alias"):
        AppConfig(models=pools, aliases={"auto": ["small", "large"]}, tier_routing={"other": {}})
    with pytest.raises(ValueError, match="rules\\[0\\]"):
        AppConfig(models=pools, aliases={"auto": ["small"]}, tier_routing={"auto": {"rules": [{"pool": "large"}]}})
    with pytest.raises(ValueError, match="extra"):
        AppConfig(
            models=pools, aliases={"auto": ["small"]}, tier_routing={"auto": {"rules": [{"pool": "small", "x": 1}]}}
        )


# --- the learned classifier ------------------------------------------------------------------

EASY = ["what is {} plus {}", "capital of country {}{}", "say hi to {} and {}", "translate word {} {}"]
HARD = [
    "write a detailed essay on {} comparing it with {} and cite evidence for each claim",
    "prove step by step that the sequence {} converges and derive its limit from {}",
    "design a distributed system for {} with failover and explain the tradeoffs of {}",
]


def _labelled(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        if i % 2:
            rows.append({"prompt": EASY[i % len(EASY)].format(i, i + 3), "max_tokens": 16, "label": "small"})
        else:
            rows.append({"prompt": HARD[i % len(HARD)].format(i, i * 7), "max_tokens": 512, "label": "large"})
    return rows


def test_the_classifier_learns_saves_and_trades_cost_with_its_threshold(tmp_path):
    rows = [(request_features(r, words), r["label"]) for r in _labelled(120)]
    model = train(rows[:80], ["small", "large"], seed=1)
    assert accuracy(model, rows[80:]) >= 0.95
    path = tmp_path / "tier.json"
    model.save(path)
    again = TierClassifier.load(path)
    f = rows[81][0]
    assert again.pools == ["small", "large"] and again.probabilities(f) == pytest.approx(
        model.probabilities(f), abs=1e-5
    )
    # The threshold is the cost knob: near 0 everything fits the small pool, at 1 the large one.
    assert {TierClassifier.load(path, 1e-6).choose(x) for x, _ in rows} == {"small"}
    assert {TierClassifier.load(path, 1.0).choose(x) for x, _ in rows} == {"large"}
    (tmp_path / "bad.json").write_text(json.dumps({"format": "x"}))
    with pytest.raises(ValueError, match="not a tier classifier"):
        TierClassifier.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="not pools"):
        train(rows, ["small"])


def test_the_training_cli_writes_what_the_policy_reads(tmp_path):
    data = tmp_path / "labelled.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _labelled(100)) + "\n")
    out = tmp_path / "tier.json"
    cmd = [sys.executable, "-m", "router.tiering", "train", "--data", str(data), "--pools", "small,large"]
    r = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "held out 20: accuracy" in r.stdout and out.exists()
    policy = TierPolicy("auto", ["small", "large"], TierRouting(classifier=str(out)))
    easy = request_features({"prompt": "what is 7 plus 9", "max_tokens": 16}, words)
    hard = request_features({"prompt": HARD[1].format("x", "y"), "max_tokens": 512}, words)
    assert [policy.decide(f, None) for f in (easy, hard)] == [
        policy.decide(easy, None).__class__(0, "classifier"),
        policy.decide(hard, None).__class__(1, "classifier"),
    ]
    with pytest.raises(ValueError, match="not in tier"):
        TierPolicy("auto", ["small"], TierRouting(classifier=str(out)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "label": "huge"}) + "\n")
    r = subprocess.run([*cmd, "--out", str(out), "--data", str(bad)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "huge" in r.stderr


# --- the ingress's choice over fake pools ----------------------------------------------------


def _tiered(*fakes, routing=None):
    from router.ingress.model_pools import ModelPools, PoolClient

    tokenizer = lambda s: SimpleNamespace(input_ids=s.split())  # noqa: E731
    pools = [
        PoolClient(
            name=f.name,
            handle=None,
            client=SimpleNamespace(tokenizer=tokenizer),
            openai=f,
            tgi=None,
            embeddings=None,
            max_model_len=100,
            expected_replicas=1,
        )
        for f in fakes
    ]
    tier = [f.name for f in fakes]
    policies = {"auto": TierPolicy("auto", tier, TierRouting(**routing))} if routing is not None else None
    return ModelPools(pools, {"auto": tier}, policies)


def _picked(p) -> dict:
    return {k: n for k, n in p.decisions.items() if n}


def test_the_ingress_starts_where_the_policy_says_and_counts_it():
    from router.ingress.errors import APIError

    p = _tiered(
        _FakeOpenAI("small"), _FakeOpenAI("large"), routing={"rules": [{"pool": "large", "min_prompt_tokens": 5}]}
    )
    run = asyncio.run
    assert run(p.completions({"model": "auto", "prompt": "one two"}))["served_by"] == "small"
    assert run(p.completions({"model": "auto", "prompt": "one two three four five"}))["served_by"] == "large"
    assert run(p.chat_completions({"model": "auto", "messages": [{"role": "user", "content": "a"}]}, "large")) == {
        "model": "auto",
        "served_by": "large",
    }
    assert _picked(p) == {("auto", "small", "default"): 1, ("auto", "large", "rule"): 1, ("auto", "large", "hint"): 1}
    for body, hint in (({"model": "auto"}, "huge"), ({"model": "small"}, "large"), ({}, "small")):
        with pytest.raises(APIError) as e:
            run(p.completions({**body, "prompt": "x"}, hint))
        assert e.value.status == 400 and e.value.param == HINT_HEADER
    # A plain alias (no tier_routing) starts at its first pool and never tokenizes.
    plain = _tiered(_FakeOpenAI("small"), _FakeOpenAI("large"))
    assert run(plain.completions({"model": "auto", "prompt": "1 2 3 4 5 6"}))["served_by"] == "small"
    assert _picked(plain) == {("auto", "small", "default"): 1}


def test_a_replica_failure_before_the_first_output_moves_on_a_request_error_does_not():
    from ray.exceptions import ActorDiedError

    from router.ingress.failover import ReplicaLostError

    small, large = _FakeOpenAI("small", fail=ReplicaLostError("gone")), _FakeOpenAI("large")
    p = _tiered(small, large, routing={})
    assert asyncio.run(p.completions({"model": "auto", "prompt": "x"}))["served_by"] == "large"
    small.fail = None
    small.stream_fail = ActorDiedError()
    chunks = asyncio.run(_drain(p, {"model": "auto", "prompt": "x", "stream": True}))
    assert [c["served_by"] for c in chunks] == ["large", "large"]
    assert _moved(p) == {("auto", "small", "large", "error"): 2}
    small.stream_fail = ValueError("the request's own error")
    with pytest.raises(ValueError):
        asyncio.run(_drain(p, {"model": "auto", "prompt": "x", "stream": True}))
    assert _moved(p) == {("auto", "small", "large", "error"): 2}


async def _drain(p, body):
    return [x async for x in await p.completions(body)]
