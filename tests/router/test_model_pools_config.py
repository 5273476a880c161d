"""Several models behind one endpoint, without a cluster: the config merge and its validation,
deployment names and CPU sums, the CLI flags, the example YAML, the metrics page with several
pools, and the ingress's pool choice and tier overflow against fake pools."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from router.config import AppConfig

ROOT = Path(__file__).resolve().parents[2]


def test_pool_fields_default_to_the_top_level():
    cfg = AppConfig(
        dtype="float32",
        max_num_seqs=4,
        kv_cache_memory_bytes=1 << 26,
        models=[{"name": "a"}, {"name": "b", "model": "/m/llama", "max_num_seqs": 1, "num_replicas": 3}],
    )
    a, b = cfg.pool_configs()
    assert (a.model_name, a.model, a.max_num_seqs, a.num_replicas, a.dtype) == ("a", None, 4, 1, "float32")
    assert (b.model_name, b.model, b.max_num_seqs, b.num_replicas, b.dtype) == ("b", "/m/llama", 1, 3, "float32")
    assert a.models is None and a.aliases == {} and b.kv_cache_memory_bytes == 1 << 26
    # The engine gets each pool's own settings under the pool's name.
    assert b.engine_args()["served_model_name"] == "b" and b.engine_args()["max_num_seqs"] == 1
    assert a.engine_args()["model"] is None
    # Defaults stay AppConfig's: a pool that sets nothing equals the top level but for its name.
    plain = AppConfig(models=[{"name": "x"}]).pool_configs()[0]
    assert plain.model_dump(exclude={"served_model_name"}) == AppConfig().model_dump(exclude={"served_model_name"})
    # `models=None` is today's single pool: the config itself.
    one = AppConfig(max_num_seqs=2)
    assert one.pool_configs() == [one]


def test_config_round_trips_through_a_dict():
    """The ingress rebuilds the config from `model_dump()`: the pools come back the same."""
    cfg = AppConfig(models=[{"name": "a"}, {"name": "b", "max_model_len": 64}], aliases={"t": ["a", "b"]})
    again = AppConfig(**cfg.model_dump())
    assert again.pool_configs() == cfg.pool_configs() and again.aliases == {"t": ["a", "b"]}


@pytest.mark.parametrize(
    "bad, words",
    [
        (dict(models=[{"name": "a"}, {"name": "a"}]), "duplicate pool name"),
        (dict(models=[{"name": "a"}], aliases={"a": ["a"]}), "also a pool name"),
        (dict(models=[{"name": "a"}], aliases={"t": ["a", "zz"]}), "unknown pool"),
        (dict(models=[{"name": "a"}], aliases={"t": []}), "names no pool"),
        (dict(models=[{"name": "a"}, {"name": "b"}], aliases={"t": ["a", "a"]}), "appears twice"),
        (dict(models=[{"name": "a", "max_num_seqs": 0}]), "models[0] ('a'): max_num_seqs"),
        (dict(models=[{"name": "a"}, {"name": "b", "dtype": "int8"}]), "models[1] ('b'): dtype"),
        (dict(models=[{"name": "a", "tensor_parallel_size": 0}]), "tensor_parallel_size"),
        (dict(models=[{"name": "a", "pipeline_parallel_size": 2, "pipeline_partition": "30"}]), "names 1 stages"),
        (dict(models=[{"name": "a", "pipeline_parallel_size": 2, "pipeline_partition": "a,b"}]), "pipeline_partition"),
        (dict(models=[{"name": "a", "no_such": 1}]), "no_such"),
        (dict(models=[{"model": "/x"}]), "name"),
        (dict(models=[{"name": ""}]), "name"),
        (dict(models=[]), "models"),
        (dict(models=[{"name": "a"}], served_model_name="x"), "served_model_name"),
        (dict(aliases={"t": ["nope"]}), "unknown pool"),
    ],
)
def test_bad_pool_configs_are_refused(bad, words):
    with pytest.raises(ValidationError) as e:
        AppConfig(**bad)
    assert words in str(e.value)


def test_an_alias_over_the_single_default_pool():
    cfg = AppConfig(served_model_name="m", aliases={"chat": ["m"]})
    assert [p.model_name for p in cfg.pool_configs()] == ["m"]


def test_deployment_names_and_cpus():
    from router.app import engine_deployment_names, required_cpus

    assert engine_deployment_names(AppConfig()) == ["EngineReplica"]
    cfg = AppConfig(
        cpus_per_worker=0.5,
        router_cpus=1,
        models=[{"name": "a"}, {"name": "org/b c"}, {"name": "org_b c"}, {"name": "t", "tensor_parallel_size": 3}],
    )
    assert engine_deployment_names(cfg) == [
        "EngineReplica-a",
        "EngineReplica-org_b_c",
        "EngineReplica-org_b_c-2",
        "EngineReplica-t",
    ]
    # 3 pools of one 0.5-CPU worker, a tp=3 pool (1 CPU per bundle at tp>1), the router.
    assert required_cpus(cfg) == 3 * 0.5 + 3 * 1.0 + 1
    assert required_cpus(AppConfig(models=[{"name": "a", "num_replicas": 2}, {"name": "b"}])) == 3.0


def test_build_app_binds_one_engine_deployment_per_pool():
    from router.app import build_app

    cfg = AppConfig(
        models=[{"name": "a"}, {"name": "b", "num_replicas": 2, "max_num_seqs": 1}], aliases={"t": ["a", "b"]}
    )
    app = build_app(cfg)
    engines, config = app._bound_deployment.init_args
    assert list(engines) == ["a", "b"]
    assert [e._bound_deployment.name for e in engines.values()] == ["EngineReplica-a", "EngineReplica-b"]
    assert [e._bound_deployment.num_replicas for e in engines.values()] == [1, 2]
    assert engines["b"]._bound_deployment.init_args[0]["max_num_seqs"] == 1
    assert AppConfig(**config).aliases == {"t": ["a", "b"]}
    single = build_app(AppConfig())
    (engine,) = single._bound_deployment.init_args[0].values()
    assert engine._bound_deployment.name == "EngineReplica"


def test_build_app_autoscales_every_pool():
    from router.app import build_app

    cfg = AppConfig(
        models=[{"name": "a"}, {"name": "b", "num_replicas": 3}],
        autoscaling={"pools": {"engine": {"min_replicas": 2, "max_replicas": 4}}},
    )
    engines, config = build_app(cfg)._bound_deployment.init_args
    for e in engines.values():
        auto = e._bound_deployment._deployment_config.autoscaling_config
        assert (auto.min_replicas, auto.max_replicas) == (2, 4)
    # The router's /health expects min_replicas of every pool.
    assert [p.num_replicas for p in AppConfig(**config).pool_configs()] == [2, 2]


def test_pool_pipeline_stages():
    """A pool's own stage count and partition; one that sets a stage count alone splits evenly
    (the top-level partition is the top-level count's)."""
    from router.app import engine_deployment_options, required_cpus

    cfg = AppConfig(
        pipeline_parallel_size=2,
        pipeline_partition="14,16",
        models=[
            {"name": "a"},
            {"name": "b", "pipeline_parallel_size": 3},
            {"name": "c", "pipeline_parallel_size": 2, "pipeline_partition": [10, 20], "tensor_parallel_size": 2},
            {"name": "d", "pipeline_parallel_size": 1},
        ],
    )
    a, b, c, d = cfg.pool_configs()
    assert [(p.pipeline_parallel_size, p.pipeline_partition) for p in (a, b, c, d)] == [
        (2, (14, 16)),
        (3, None),
        (2, (10, 20)),
        (1, None),
    ]
    assert c.engine_args()["pipeline_partition"] == (10, 20)
    assert engine_deployment_options(c)["placement_group_strategy"] == "PACK"
    assert engine_deployment_options(d)["placement_group_strategy"] == "STRICT_PACK"
    assert required_cpus(cfg) == 2 + 3 + 4 + 1  # a CPU per rank (bundles of >1-rank replicas)
    assert AppConfig(**cfg.model_dump()).pool_configs() == cfg.pool_configs()


def test_prefill_pool_pipeline_stages():
    cfg = AppConfig(prefill_replicas=1, pipeline_parallel_size=2, pipeline_partition="14,16")
    same = cfg.prefill_pool_config()
    assert (same.pipeline_parallel_size, same.pipeline_partition) == (2, (14, 16))
    other = cfg.model_copy(update={"prefill_pipeline_parallel_size": 1}).prefill_pool_config()
    assert (other.pipeline_parallel_size, other.pipeline_partition) == (1, None)
    with pytest.raises(ValidationError):
        AppConfig(prefill_replicas=1, prefill_pipeline_parallel_size=0)


def test_cli_model_pools_and_aliases():
    import argparse

    from router.cli import build_parser, config_from_args, parse_alias, parse_model_pool

    a = build_parser().parse_args(
        [
            "serve",
            "--num-cpus",
            "8",
            "--max-num-seqs",
            "16",
            "--model-pool",
            "name=small,replicas=2,max-num-seqs=4",
            "--model-pool",
            "name=big,model=/m/llama,tp=2,dtype=bfloat16",
            "--model-pool",
            "name=huge,pp=2,pipeline-partition=14,16,replicas=1",
            "--alias",
            "chat=small,big",
        ]
    )
    cfg = config_from_args(a)
    small, big, huge = cfg.pool_configs()
    assert (huge.pipeline_parallel_size, huge.pipeline_partition, huge.tensor_parallel_size) == (2, (14, 16), 1)
    assert huge.engine_args()["pipeline_parallel_size"] == 2 and small.pipeline_parallel_size == 1
    assert (small.model_name, small.num_replicas, small.max_num_seqs, small.tensor_parallel_size) == ("small", 2, 4, 1)
    assert (big.model_name, big.model, big.tensor_parallel_size, big.dtype, big.max_num_seqs) == (
        "big",
        "/m/llama",
        2,
        "bfloat16",
        16,
    )
    assert cfg.aliases == {"chat": ["small", "big"]}
    assert cfg.cpus_per_worker == 1.0  # 8 cores over 2 + 2 + 2 ranks
    assert parse_model_pool("name=x,pipeline_partition=1, 2,3,pp=3") == {
        "name": "x",
        "pipeline_partition": "1,2,3",
        "pipeline_parallel_size": "3",
    }
    for bad in ("model=/x", "name=a,colour=red", "name=a,replicas", "name=a,tp=2,4"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_model_pool(bad)
    for bad in ("chat", "chat=", "=a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_alias(bad)
    # Without the flags: one pool, as always.
    plain = config_from_args(build_parser().parse_args(["serve"]))
    assert plain.models is None and plain.aliases == {}


def test_multi_model_yaml_validates_and_builds():
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.deployment import Application
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load((ROOT / "deploy" / "serve-multi-model.yaml").read_text())
    ServeDeploySchema.model_validate(raw)
    args = raw["applications"][0]["args"]
    cfg = AppConfig(**args)
    assert [p.model_name for p in cfg.pool_configs()] == ["smol", "smol-batch"]
    assert cfg.aliases == {"chat": ["smol", "smol-batch"]}
    app = call_user_app_builder_with_args_if_necessary(import_attr(raw["applications"][0]["import_path"]), args)
    assert isinstance(app, Application)


def test_metrics_page_with_several_pools_parses():
    from prometheus_client.parser import text_string_to_metric_families

    from router.metrics import render_pools

    def replica(**kw):
        return {"num_running": 1, "generation_tokens": 10, "finished": {"stop": 2}, **kw}

    text = render_pools(
        [("a", [replica(), replica()], {"in_flight": 1}), ("b", [replica(generation_tokens=5)], {"rejected": 3})],
        {("t", "a", "b", "overload"): 4, ("t", "a", "b", "error"): 0},
        tier_decisions={("t", "a", "rule"): 2, ("t", "b", "hint"): 1},
    ).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    # One HELP and one TYPE line per family, every pool's series under it.
    assert text.count("# TYPE orbital:generation_tokens") == 1 and text.count("# HELP orbital:generation_tokens") == 1
    gen = {
        s.labels["model_name"]: s.value for s in fams["orbital:generation_tokens"].samples if s.name.endswith("_total")
    }
    assert gen == {"a": 20.0, "b": 5.0}
    assert {s.labels["model_name"]: s.value for s in fams["orbital:num_replicas"].samples} == {"a": 2.0, "b": 1.0}
    rejected = {
        s.labels["model_name"]: s.value
        for s in fams["orbital:num_requests_rejected"].samples
        if s.name.endswith("_total")
    }
    assert rejected == {"a": 0.0, "b": 3.0}
    hist = [s for s in fams["orbital:time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert sorted(s.labels["model_name"] for s in hist) == ["a", "b"]
    moved = {s.labels["cause"]: s for s in fams["orbital:tier_overflows"].samples if s.name.endswith("_total")}
    assert moved["overload"].labels == {"alias": "t", "from_pool": "a", "to_pool": "b", "cause": "overload"}
    assert moved["overload"].value == 4.0 and moved["error"].value == 0.0
    picked = {(s.labels["pool"], s.labels["reason"]): s.value for s in fams["orbital:tier_decisions"].samples}
    assert picked == {("a", "rule"): 2.0, ("b", "hint"): 1.0}
    for fam in fams.values():
        if fam.name not in ("orbital:tier_overflows", "orbital:tier_decisions"):
            assert all("model_name" in s.labels for s in fam.samples), fam.name


# --- the ingress's pool choice, against fake pools ------------------------------------------------


class _FakeOpenAI:
    """Answers as the named pool, or raises what it is told to before its first output."""

    def __init__(self, name: str, fail=None, stream_fail=None) -> None:
        self.name, self.fail, self.stream_fail, self.calls = name, fail, stream_fail, 0

    async def completions(self, body: dict, served_as: str | None = None):
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        if body.get("stream"):
            return self._stream(served_as)
        return {"model": served_as, "served_by": self.name}

    async def _stream(self, served_as):
        if self.stream_fail is not None:
            raise self.stream_fail
        for i in range(2):
            yield {"model": served_as, "served_by": self.name, "i": i}

    chat_completions = completions


def _pools(*fakes, aliases=None):
    from router.ingress.model_pools import ModelPools, PoolClient

    pools = [
        PoolClient(
            name=f.name,
            handle=None,
            client=None,
            openai=f,
            tgi=None,
            embeddings=None,
            max_model_len=100 + i,
            expected_replicas=1,
        )
        for i, f in enumerate(fakes)
    ]
    return ModelPools(pools, aliases)


def _moved(p) -> dict:
    return {k: n for k, n in p.overflows.items() if n}


def _run(coro):
    return asyncio.run(coro)


async def _drain(it):
    return [x async for x in it]


def test_requests_go_to_the_named_pool():
    from router.ingress.errors import APIError

    p = _pools(_FakeOpenAI("a"), _FakeOpenAI("b"), aliases={"t": ["b", "a"]})
    assert _run(p.completions({"model": "b"})) == {"model": "b", "served_by": "b"}
    assert _run(p.completions({"model": "a"}))["served_by"] == "a"
    for default in ({}, {"model": ""}, {"model": None}):
        assert _run(p.completions(default)) == {"model": "a", "served_by": "a"}
    assert _run(p.chat_completions({"model": "t"})) == {"model": "t", "served_by": "b"}
    with pytest.raises(APIError) as e:
        _run(p.completions({"model": "nope"}))
    assert e.value.status == 404 and e.value.openai_body()["error"]["code"] == "model_not_found"
    cards = p.models()["data"]
    assert [(c["id"], c["root"], c["max_model_len"]) for c in cards] == [
        ("a", "a", 100),
        ("b", "b", 101),
        ("t", "b", 101),
    ]


def test_tier_overflows_only_when_a_pool_sheds_load():
    from ray.exceptions import RayTaskError

    from router.backpressure import OverloadedError

    busy = _FakeOpenAI("a", fail=OverloadedError("full", 3))
    b = _FakeOpenAI("b")
    p = _pools(busy, b, aliases={"t": ["a", "b"]})
    assert _run(p.completions({"model": "t"})) == {"model": "t", "served_by": "b"}
    assert _moved(p) == {("t", "a", "b", "overload"): 1}
    # Asking for the pool itself never overflows: its 429 is the answer.
    with pytest.raises(OverloadedError):
        _run(p.completions({"model": "a"}))
    assert _moved(p) == {("t", "a", "b", "overload"): 1}
    # The engine replica's 429 arrives wrapped by Ray: it moves on too.
    busy.fail = RayTaskError("submit", "tb", OverloadedError("replica full"))
    assert _run(p.completions({"model": "t"}))["served_by"] == "b"
    assert _moved(p) == {("t", "a", "b", "overload"): 2}
    # Any other error is the answer, and the next pool is not asked.
    busy.fail, b.calls = ValueError("bad request"), 0
    with pytest.raises(ValueError):
        _run(p.completions({"model": "t"}))
    assert b.calls == 0 and _moved(p) == {("t", "a", "b", "overload"): 2}
    # Every pool sheds: the last one's 429.
    busy.fail, b.fail = OverloadedError("a full"), OverloadedError("b full", 7)
    with pytest.raises(OverloadedError) as e:
        _run(p.completions({"model": "t"}))
    assert str(e.value) == "b full" and e.value.retry_after == 7
    assert _moved(p) == {("t", "a", "b", "overload"): 3}


def test_streams_overflow_before_their_first_chunk():
    from router.backpressure import OverloadedError

    a = _FakeOpenAI("a", stream_fail=OverloadedError("full"))
    p = _pools(a, _FakeOpenAI("b"), aliases={"t": ["a", "b"]})
    chunks = _run(_drain_call(p, {"model": "t", "stream": True}))
    assert [c["served_by"] for c in chunks] == ["b", "b"] and all(c["model"] == "t" for c in chunks)
    assert _moved(p) == {("t", "a", "b", "overload"): 1}
    a.stream_fail = None
    chunks = _run(_drain_call(p, {"model": "t", "stream": True}))
    assert [c["served_by"] for c in chunks] == ["a", "a"] and _moved(p) == {("t", "a", "b", "overload"): 1}


async def _drain_call(p, body):
    return await _drain(await p.completions(body))
