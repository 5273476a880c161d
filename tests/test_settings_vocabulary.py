"""One vocabulary per setting: the allowed values of every enumerated setting live in
`engine/choices.py` and every default in `EngineArgs`; `AppConfig`, both CLIs and the engine's own
checks agree with them, and no source file spells one of these lists out again."""

from __future__ import annotations

import argparse
import ast
import pathlib
import typing

import pytest

from engine import choices
from engine.engine_args import EngineArgs
from router.config import REASONING_PARSERS, AppConfig
from router.replica_choice.peer_fetch_plan import MODES as PEER_FETCH_MODES

ROOT = pathlib.Path(__file__).resolve().parents[1]
# setting -> (its vocabulary, AppConfig's field, the flag in both CLIs or None)
SETTINGS = {
    "dtype": (choices.DTYPES, "dtype", "--dtype"),
    "kv_cache_dtype": (choices.KV_CACHE_DTYPES, "kv_cache_dtype", "--kv-cache-dtype"),
    "quantization": (choices.QUANTIZATION_METHODS, "quantization", "--quantization"),
    "scheduling_policy": (choices.SCHEDULING_POLICIES, "scheduling_policy", None),
    "pooling_type": (choices.POOLING_TYPES, "pooling_type", "--pooling-type"),
    "kv_offload_medium": (choices.KV_OFFLOAD_MEDIA, "kv_offload_medium", "--kv-offload-medium"),
}


def _literal_values(annotation) -> set:
    values = set()
    for arg in typing.get_args(annotation) or ():
        values |= _literal_values(arg) if typing.get_args(arg) else {arg}
    if typing.get_origin(annotation) is typing.Literal:
        values = set(typing.get_args(annotation))
    return values - {type(None)}


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option of a parser and of its subcommands, by flag."""
    seen: dict[str, argparse.Action] = {}
    for act in parser._actions:
        for flag in act.option_strings:
            seen.setdefault(flag, act)
        if isinstance(act, argparse._SubParsersAction):
            for sub in act.choices.values():
                for flag, inner in _flags(sub).items():
                    seen.setdefault(flag, inner)
    return seen


def _engine_cli_parser() -> argparse.ArgumentParser:
    """engine/cli.py's parser, caught as parse_args builds it (not run)."""
    from engine import cli

    caught = []
    real = argparse.ArgumentParser.parse_args

    def catch(self, *a, **k):
        caught.append(self)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = catch
    try:
        cli.parse_args([])
    except SystemExit:
        pass
    finally:
        argparse.ArgumentParser.parse_args = real
    return caught[0]


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_appconfig_takes_exactly_the_engine_s_values_and_default(setting):
    vocab, field, _ = SETTINGS[setting]
    info = AppConfig.model_fields[field]
    assert _literal_values(info.annotation) == set(vocab), setting
    assert info.default == getattr(EngineArgs, setting)


def test_both_clis_offer_the_vocabulary_and_the_defaults():
    from router.cli import build_parser

    engine_flags, router_flags = _flags(_engine_cli_parser()), _flags(build_parser())
    for setting, (vocab, _, flag) in SETTINGS.items():
        if flag is None:
            continue
        for name, flags in (("engine", engine_flags), ("router", router_flags)):
            assert flag in flags, (name, flag)
            assert set(flags[flag].choices) == set(vocab), (name, flag)
    for flag, field in (("--max-num-seqs", "max_num_seqs"), ("--max-num-batched-tokens", "max_num_batched_tokens")):
        assert engine_flags[flag].default == getattr(EngineArgs, field), flag
    assert router_flags["--scheduling-policy"].choices == list(choices.SCHEDULING_POLICIES)
    for flag, field in (("--pp", "pipeline_parallel_size"), ("--pipeline-partition", "pipeline_partition")):
        assert engine_flags[flag].default == router_flags[flag].default == getattr(EngineArgs, field), flag
        assert AppConfig.model_fields[field].default == getattr(EngineArgs, field), field


def test_the_engine_cli_hands_the_pipeline_to_the_engine(monkeypatch):
    import engine
    from engine.cli import main

    seen = {}

    class FakeLLM:
        def __init__(self, model, **kwargs):
            seen.update(kwargs)

        def generate(self, prompts, params, lora_request=None):
            return []

    monkeypatch.setattr(engine, "LLM", FakeLLM)
    assert main(["--prompt", "hi", "--tp", "2", "--pp", "2", "--pipeline-partition", "14,16"]) == 0
    assert (seen["tensor_parallel_size"], seen["pipeline_parallel_size"], seen["pipeline_partition"]) == (2, 2, "14,16")
    seen.pop("executor_factory")
    EngineArgs(**seen)  # every other keyword is an engine setting


def test_reasoning_parsers_are_one_vocabulary():
    """A router setting: its values live in router/config.py, read by AppConfig and the CLI."""
    from router.cli import build_parser

    assert _literal_values(AppConfig.model_fields["reasoning_parser"].annotation) == set(REASONING_PARSERS)
    assert _flags(build_parser())["--reasoning-parser"].choices == list(REASONING_PARSERS)


def test_peer_fetch_modes_are_one_vocabulary():
    """A router setting: its values live in router/replica_choice/peer_fetch_plan.py, read by
    AppConfig, the CLI and the request router."""
    from router.cli import build_parser

    info = AppConfig.model_fields["kv_peer_fetch"]
    assert _literal_values(info.annotation) == set(PEER_FETCH_MODES) and info.default in PEER_FETCH_MODES
    flag = _flags(build_parser())["--kv-peer-fetch"]
    assert flag.choices == list(PEER_FETCH_MODES) and flag.default == info.default


def test_no_second_spelling_of_a_vocabulary():
    """A literal tuple/list/set equal to one of the vocabularies, anywhere in the product code
    but engine/choices.py (and router/config.py's one REASONING_PARSERS), is a second definition
    (it would drift)."""
    vocabularies = {frozenset(v) for v, _, _ in SETTINGS.values()} | {frozenset(choices.SPECULATIVE_METHODS)}
    vocabularies.add(frozenset(REASONING_PARSERS))
    vocabularies.add(frozenset(PEER_FETCH_MODES))
    found = []
    for package in ("engine", "router", "workers", "loadtest"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "choices.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2:
                    consts = [e.value for e in node.elts if isinstance(e, ast.Constant)]
                    if len(consts) == len(node.elts) and frozenset(consts) in vocabularies:
                        found.append((f"{path.relative_to(ROOT)}", frozenset(consts), node.lineno))
    definitions = [
        ("router/config.py", frozenset(REASONING_PARSERS)),
        ("router/replica_choice/peer_fetch_plan.py", frozenset(PEER_FETCH_MODES)),
    ]
    for definition in definitions:
        assert [f[:2] for f in found].count(definition) == 1, found
    assert [f for f in found if f[:2] not in definitions] == [], found


def test_the_engine_refuses_what_the_vocabulary_leaves_out():
    import torch

    from engine.config import check_kv_cache_dtype
    from engine.errors import InvalidRequestError
    from engine.layers.quant.spec import parse_quantization
    from engine.model_config import resolve_dtype

    for bad in ("bf16", "fp32", "half"):
        with pytest.raises(InvalidRequestError):
            resolve_dtype(bad, torch.device("cpu"))
    for good in choices.DTYPES[1:]:
        assert resolve_dtype(good, torch.device("cpu")) == getattr(torch, good)
    with pytest.raises(InvalidRequestError):
        check_kv_cache_dtype("fp8")
    with pytest.raises(InvalidRequestError):
        parse_quantization("int3")
