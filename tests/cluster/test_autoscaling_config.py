"""deploy/autoscaling.yaml: schema, loader errors naming the bad field, translation into Serve's
AutoscalingConfig and deployment options, and the policy's arithmetic."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from router.controller.autoscaling_config import (
    AutoscalingConfigError,
    autoscaled,
    load_autoscaling,
    pool_deployment_options,
    serve_autoscaling_config,
    spread_share,
)
from router.controller.autoscaling_policy import OrbitalPolicy, desired_replicas

ROOT = Path(__file__).resolve().parents[2]
RAW = yaml.safe_load((ROOT / "deploy/autoscaling.yaml").read_text())


def test_shipped_file_loads():
    pool = load_autoscaling(ROOT / "deploy/autoscaling.yaml").pools["engine"]
    assert (pool.min_replicas, pool.max_replicas) == (1, 8)
    assert pool.targets.ttft_slo_s == 3.0 and pool.placement.max_replicas_per_node == 1
    # relative to the project when the working directory is elsewhere
    assert load_autoscaling("deploy/autoscaling.yaml") == load_autoscaling(str(ROOT / "deploy/autoscaling.yaml"))


def with_engine(**changes) -> dict:
    raw = copy.deepcopy(RAW)
    for dotted, value in changes.items():
        node = raw["pools"]["engine"]
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return raw


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"min_replicas": 0}, "pools.engine.min_replicas"),
        ({"max_replicas": -1}, "pools.engine.max_replicas"),
        ({"max_replicas": "many"}, "pools.engine.max_replicas"),
        ({"initial_replicas": 0}, "pools.engine.initial_replicas"),
        ({"upscale_delay_s": -5}, "pools.engine.upscale_delay_s"),
        ({"downscale_delay_s": -1}, "pools.engine.downscale_delay_s"),
        ({"look_back_period_s": 0}, "pools.engine.look_back_period_s"),
        ({"drain_timeout_s": 0}, "pools.engine.drain_timeout_s"),
        ({"metrics_interval_s": 0}, "pools.engine.metrics_interval_s"),
        ({"targets__ongoing_requests_per_replica": 0}, "pools.engine.targets.ongoing_requests_per_replica"),
        ({"targets__kv_cache_usage": 1.5}, "pools.engine.targets.kv_cache_usage"),
        ({"targets__queue_wait_s": -1}, "pools.engine.targets.queue_wait_s"),
        ({"targets__ttft_slo_s": 0}, "pools.engine.targets.ttft_slo_s"),
        ({"targets__max_step": 0.5}, "pools.engine.targets.max_step"),
        ({"placement__max_replicas_per_node": 0}, "pools.engine.placement.max_replicas_per_node"),
        ({"targets__ttft_slo": 3}, "pools.engine.targets.ttft_slo"),  # typo'd key
        ({"upscale_delay": 3}, "pools.engine.upscale_delay"),  # typo'd key
    ],
)
def test_bad_field_is_named(changes, field):
    with pytest.raises(AutoscalingConfigError) as e:
        load_autoscaling(with_engine(**changes))
    assert f"{field}:" in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "changes,words",
    [
        ({"min_replicas": 3, "max_replicas": 2}, ["max_replicas (2)", "min_replicas (3)"]),
        ({"look_back_period_s": 2, "metrics_interval_s": 2}, ["look_back_period_s (2.0)", "metrics_interval_s (2.0)"]),
        ({"initial_replicas": 9}, ["initial_replicas (9)"]),
    ],
)
def test_cross_field_errors_name_the_fields(changes, words):
    with pytest.raises(AutoscalingConfigError) as e:
        load_autoscaling(with_engine(**changes))
    for w in words:
        assert w in str(e.value)


def test_unknown_pool_and_bad_files(tmp_path):
    with pytest.raises(AutoscalingConfigError, match="unknown pool"):
        load_autoscaling({"pools": {"engin": {}}})
    with pytest.raises(AutoscalingConfigError, match="not found"):
        load_autoscaling(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: [1, 2\n")
    with pytest.raises(AutoscalingConfigError, match="not valid YAML"):
        load_autoscaling(bad)
    bad.write_text("- 1\n")
    with pytest.raises(AutoscalingConfigError, match="expected a mapping"):
        load_autoscaling(bad)


def test_translation_to_serve():
    from ray.serve.config import AutoscalingConfig

    pool = load_autoscaling(RAW).pools["engine"]
    ac = serve_autoscaling_config(pool)
    assert isinstance(ac, AutoscalingConfig)
    assert (ac.min_replicas, ac.max_replicas, ac.upscale_delay_s, ac.downscale_delay_s, ac.look_back_period_s) == (
        1,
        8,
        15.0,
        180.0,
        15.0,
    )
    assert ac.policy.policy_function == "router.controller.autoscaling_policy:OrbitalPolicy"
    assert ac.policy.policy_kwargs["ttft_slo_s"] == 3.0 and ac.policy.policy_kwargs["target_ongoing_requests"] == 16
    # Serve can import and instantiate it the way its controller does
    ac.policy.serialize_policy()
    policy = ac.policy.get_policy()(**ac.policy.policy_kwargs)
    assert callable(policy)


def test_deployment_options_and_app_config():
    from router.app import engine_deployment_options
    from router.config import AppConfig

    cfg = AppConfig(autoscaling=str(ROOT / "deploy/autoscaling.yaml"), tensor_parallel_size=2, num_replicas=3)
    cfg2, opts = autoscaled(cfg, engine_deployment_options(cfg))
    assert "num_replicas" not in opts and opts["autoscaling_config"].max_replicas == 8
    assert opts["graceful_shutdown_timeout_s"] == 900.0
    assert opts["placement_group_strategy"] == "STRICT_PACK" and len(opts["placement_group_bundles"]) == 2
    assert opts["placement_group_bundles"][0]["orbital_node"] == 1.0
    assert "orbital_node" not in opts["placement_group_bundles"][1]
    assert opts["autoscaling_config"].metrics_interval_s == 2.0
    assert opts["ray_actor_options"] == {"num_cpus": 1.0}  # tp=2: the replica is rank 0 (bundle 0)
    assert cfg2.num_replicas == 1 and isinstance(cfg2.autoscaling, dict)  # inline for the router replicas
    AppConfig(**cfg2.model_dump())  # round-trips
    plain = AppConfig()
    assert autoscaled(plain, {"num_replicas": 1}) == (plain, {"num_replicas": 1})


@pytest.mark.parametrize("k", [1, 2, 3, 7, 100])
def test_spread_share_fits_k_per_node(k):
    assert k * spread_share(k) <= 1.0 < (k + 1) * spread_share(k)
    opts = pool_deployment_options(
        load_autoscaling(with_engine(placement__max_replicas_per_node=k)).pools["engine"],
        {"placement_group_bundles": [{"CPU": 1}]},
    )
    assert opts["placement_group_bundles"][0]["orbital_node"] == spread_share(k)


def test_cli_accepts_autoscaling():
    from router.cli import build_parser, config_from_args

    a = build_parser().parse_args(["serve", "--autoscaling", "deploy/autoscaling.yaml", "--num-cpus", "16"])
    cfg = config_from_args(a)
    assert cfg.autoscaling == "deploy/autoscaling.yaml"
    assert cfg.cpus_per_worker == 2.0  # 16 CPUs over max_replicas=8 workers


# --- the policy's arithmetic ----------------------------------------------------------------


def M(**per_replica):  # metric name -> {replica: value}
    return {k: dict(enumerate(v)) for k, v in per_replica.items()}


def test_ongoing_signal_uses_larger_of_serve_and_replica_counts():
    want, s = desired_replicas(2, 4.0, M(in_flight=[10, 10]), target_ongoing_requests=4)
    assert want == 5.0 and s == {"ongoing": 5.0}
    want, _ = desired_replicas(2, 30.0, M(in_flight=[1, 1]), target_ongoing_requests=4)
    assert want == 7.5


def test_latency_and_kv_signals():
    kw = dict(target_ongoing_requests=100, target_kv_cache_usage=0.5, target_queue_wait_s=1.0, ttft_slo_s=2.0)
    want, s = desired_replicas(
        2, 0, M(in_flight=[1, 1], kv_cache_usage=[0.9, 0.7], queue_wait_s=[0.0, 0.5], ttft_s=[1.0, 3.0]), **kw
    )
    assert s["kv"] == pytest.approx(3.2) and s["queue"] == pytest.approx(1.0) and s["ttft"] == pytest.approx(3.0)
    assert want == pytest.approx(3.2)
    # an SLO blown by 100x asks for at most max_step times the current replicas
    want, s = desired_replicas(2, 0, M(ttft_s=[200.0]), **kw)
    assert s["ttft"] == 4.0 and want == 4.0
    # idle: every signal low, the pool may shrink
    want, _ = desired_replicas(3, 0, M(in_flight=[0, 0, 0], kv_cache_usage=[0, 0, 0], ttft_s=[0, 0, 0]), **kw)
    assert want == 0.0


class Ctx:
    def __init__(self, n, total, metrics):
        self.current_num_replicas, self.target_num_replicas = n, n
        self.total_num_requests, self.aggregated_metrics = total, metrics
        self.policy_state, self.deployment_name = {}, "EngineReplica"


def test_policy_object():
    p = OrbitalPolicy(target_ongoing_requests=2, ttft_slo_s=1.0)
    want, state = p(Ctx(1, 6.0, M(ttft_s=[0.5])))
    assert want == 3.0 and state["orbital_signals"] == {"ongoing": 3.0, "ttft": 0.5}
    assert p(Ctx(0, 0.0, {}))[0] == 0
    with pytest.raises(ValueError):
        OrbitalPolicy(target_ongoing_requests=0)


# --- tail-latency signals ----------------------------------------------------------------------


def test_histogram_quantile_interpolates_inside_buckets():
    from router.histogram import Histogram

    h = Histogram((0.1, 0.2, 0.4))
    for v in [0.05] * 90 + [0.3] * 10:
        h.observe(v)
    # 95 of 100: the 5th of the 10 in (0.2, 0.4] -> halfway through that bucket
    assert h.quantile(0.95) == pytest.approx(0.3)
    assert h.quantile(0.5) == pytest.approx(0.1 * 50 / 90)
    since = list(h.counts)
    assert h.quantile(0.95, since) == 0.0  # nothing new
    for v in [1.0] * 20:  # past the last bound: reads as the largest bound
        h.observe(v)
    assert h.quantile(0.95, since) == 0.4
    assert h.quantile(0.95) == 0.4 and 0.1 < h.quantile(0.8) < 0.4


def test_replica_reports_recent_p95_not_the_mean():
    from engine.stats import EngineStats
    from router.metrics import new_histograms
    from router.replica.autoscaling_stats import AutoscalingStats

    hist = new_histograms()
    stats = AutoscalingStats(hist)
    idle = EngineStats()
    assert stats.snapshot(idle, 0)["ttft_p95_s"] == 0.0
    for v in [0.05] * 93 + [2.5] * 7:  # a slow tail: the mean stays low, the p95 does not
        hist["time_to_first_token_seconds"].observe(v)
    for v in [0.02] * 90 + [0.4] * 10:
        hist["inter_token_latency_seconds"].observe(v)
    s = stats.snapshot(idle, 0)
    assert s["ttft_s"] < 0.25 and s["ttft_p95_s"] > 1.0
    assert s["itl_p95_s"] > 0.1
    # the next interval sees only what came after: nothing, so 0
    s = stats.snapshot(idle, 0)
    assert s["ttft_p95_s"] == 0.0 and s["itl_p95_s"] == 0.0


def test_p95_targets_scale_the_pool():
    kw = dict(target_ongoing_requests=100, ttft_p95_slo_s=1.0, itl_p95_slo_s=0.1)
    want, s = desired_replicas(2, 0, M(in_flight=[1, 1], ttft_p95_s=[0.5, 1.5], itl_p95_s=[0.05, 0.12]), **kw)
    assert s["ttft_p95"] == pytest.approx(3.0) and s["itl_p95"] == pytest.approx(2.4) and want == pytest.approx(3.0)
    # the mean-TTFT signal stays off when only the p95 is targeted
    assert "ttft" not in s
    want, s = desired_replicas(4, 0, M(ttft_p95_s=[0.1] * 4, itl_p95_s=[0.01] * 4), **kw)
    assert want == pytest.approx(0.4)  # well inside both targets: the pool may shrink


def test_p95_targets_from_the_policy_file():
    cfg = load_autoscaling({"pools": {"engine": {"targets": {"ttft_p95_s": 2.0, "itl_p95_s": 0.15}}}})
    kwargs = serve_autoscaling_config(cfg.pools["engine"]).policy.policy_kwargs
    assert kwargs["ttft_p95_slo_s"] == 2.0 and kwargs["itl_p95_slo_s"] == 0.15
    p = OrbitalPolicy(**kwargs)
    want, state = p(Ctx(1, 0.0, M(ttft_p95_s=[4.0], itl_p95_s=[0.1])))
    assert want == 2.0 and state["orbital_signals"]["ttft_p95"] == 2.0
