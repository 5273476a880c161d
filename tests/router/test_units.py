"""Fast checks of the router's parts without Ray: metrics text, queues, config, error mapping,
request models, TGI parameter mapping, replica ranking, the Serve YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from engine.errors import EngineDeadError, InvalidRequestError
from router.backpressure import IngressQueue, OverloadedError, ReplicaQueue
from router.config import AppConfig
from router.histogram import Histogram
from router.ingress.errors import APIError, to_api_error
from router.ingress.openai_models import ChatCompletionRequest, CompletionRequest
from router.ingress.tgi_api import sampling_params
from router.ingress.tgi_models import GenerateParameters
from router.metrics import HISTOGRAMS, new_histograms, render
from router.replica_choice.least_loaded import replica_load

ROOT = Path(__file__).resolve().parents[2]


def _replica(**kw):
    h = new_histograms()
    h["time_to_first_token_seconds"].observe(0.03)
    h["e2e_request_latency_seconds"].observe(1.2)
    s = {
        "num_running": 2,
        "num_waiting": 1,
        "blocks_used": 10,
        "num_blocks": 100,
        "prompt_tokens": 50,
        "generation_tokens": 20,
        "prefix_cache_queries": 64,
        "prefix_cache_hits": 16,
        "num_preemptions": 1,
        "finished": {"length": 3, "abort": 1},
        "queue": {"rejected": 2},
        "histograms": {k: v.to_dict() for k, v in h.items()},
    }
    s.update(kw)
    return s


def test_metrics_render_parses_and_aggregates():
    text = render("m", [_replica(), _replica(blocks_used=30)], {"in_flight": 3, "queued": 1, "rejected": 1})
    fams = {f.name: f for f in text_string_to_metric_families(text.decode())}
    val = {
        s.name + str(sorted((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
        for f in fams.values()
        for s in f.samples
    }
    assert val["orbital:num_requests_running[]"] == 4
    assert val["orbital:kv_cache_usage_perc[]"] == pytest.approx(0.2)
    assert val["orbital:prompt_tokens_total[]"] == 100
    assert val["orbital:num_requests_rejected_total[]"] == 5
    assert val["orbital:request_success_total[('finished_reason', 'abort')]"] == 2
    assert val["orbital:time_to_first_token_seconds_count[]"] == 2
    assert val["orbital:time_to_first_token_seconds_bucket[('le', '0.04')]"] == 2
    assert val["orbital:time_to_first_token_seconds_bucket[('le', '0.02')]"] == 0
    assert val["orbital:e2e_request_latency_seconds_sum[]"] == pytest.approx(2.4)
    assert all(s.labels.get("model_name") == "m" for f in fams.values() for s in f.samples)
    for name in HISTOGRAMS:
        assert f"orbital:{name}" in fams


def test_histogram_buckets():
    h = Histogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 5.0):
        h.observe(v)
    assert h.counts == [2, 1, 1] and h.count == 4 and h.total == 8.0


def test_queues():
    q = IngressQueue(2)
    q.admit("a")
    q.admit("b")
    with pytest.raises(OverloadedError) as e:
        q.admit("c")
    assert e.value.retry_after == 1 and q.stats()["rejected"] == 1
    q.started("a")  # generating: no longer queued
    q.admit("c")
    assert q.stats() == {"queued": 2, "in_flight": 3, "rejected": 1}
    for r in "abc":
        q.done(r)
    assert q.stats()["in_flight"] == 0
    import pickle

    err = pickle.loads(pickle.dumps(OverloadedError("x", 3)))
    assert err.retry_after == 3 and str(err) == "x"
    with pytest.raises(ValueError):
        ReplicaQueue(0)


def test_error_mapping():
    assert to_api_error(InvalidRequestError("bad", param="n")).status == 400
    e = to_api_error(OverloadedError("busy"))
    assert (
        e.status == 429 and e.headers["Retry-After"] == "1" and e.openai_body()["error"]["type"] == "rate_limit_error"
    )
    assert to_api_error(EngineDeadError("x")).status == 503
    assert to_api_error(TimeoutError()).status == 504
    assert to_api_error(RuntimeError("boom")).status == 500
    e = APIError(400, "no", param="p")
    assert e.tgi_status() == 422 and e.tgi_body() == {"error": "no", "error_type": "validation"}
    with pytest.raises(ValidationError) as v:
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": "many"})
    assert to_api_error(v.value).param == "max_tokens"


def test_request_models():
    r = CompletionRequest.model_validate({"prompt": [1, 2, 3], "unknown_field": 1})
    assert r.prompt == [1, 2, 3] and r.max_tokens == 16
    c = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    )
    assert c.messages[0].text() == "ab" and c.max_tokens is None
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": []})


def test_tgi_sampling():
    greedy = sampling_params(GenerateParameters(), want_logprobs=False)
    assert greedy.temperature == 0.0 and greedy.max_tokens == 100 and greedy.logprobs is None
    s = sampling_params(GenerateParameters(do_sample=True, temperature=0.7, stop=["\n"], seed=1), want_logprobs=True)
    assert s.temperature == 0.7 and s.include_stop_str_in_output and s.logprobs == 0 and s.seed == 1
    assert sampling_params(GenerateParameters(top_k=5), False).temperature == 1.0  # top_k implies sampling
    for bad in ({"temperature": 0.0}, {"max_new_tokens": 0}, {"best_of": 2}, {"grammar": {}}, {"top_n_tokens": 21}):
        with pytest.raises(ValidationError):
            GenerateParameters(**bad)
    with pytest.raises(InvalidRequestError):
        sampling_params(GenerateParameters(stop=[""]), False)  # SamplingParams: empty stop string


def test_replica_load_ranking():
    idle = replica_load(0, {"num_waiting": 0, "kv_usage": 0.1})
    busy = replica_load(3, {"num_waiting": 0, "kv_usage": 0.0})
    assert idle < busy
    assert replica_load(None, {"in_flight": 2}) == 2  # no cache entry: the replica's own figure
    assert replica_load(1, {"kv_usage": 0.9}) > replica_load(1, {"kv_usage": 0.1})


def test_config_and_yaml():
    with pytest.raises(ValidationError):
        AppConfig(tensor_parallel_size=0)
    with pytest.raises(ValidationError):
        AppConfig(no_such_key=1)
    cfg = AppConfig(model="/models/my-llama", num_threads=2)
    assert cfg.model_name == "my-llama" and cfg.engine_args()["num_threads"] == 2
    raw = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(raw) if hasattr(
        ServeDeploySchema, "model_validate"
    ) else ServeDeploySchema.parse_obj(raw)
    app = raw["applications"][0]
    assert app["import_path"] == "router.app:app_builder"
    assert AppConfig(**app["args"]).model_name == "SmolLM2-135M-Instruct"


def test_kv_budget_defaults_to_gpu_memory_share_on_cuda():
    from engine.engine_args import EngineArgs

    args = AppConfig().engine_args()
    assert args["kv_cache_memory_bytes"] is None and args["gpu_memory_utilization"] == 0.9
    EngineArgs(**args)  # the replica's engine takes them as they are (1 GiB on CPU)
    assert AppConfig(kv_cache_memory_bytes=1 << 28).engine_args()["kv_cache_memory_bytes"] == 1 << 28
    for bad in (0, 1.5):
        with pytest.raises(ValidationError):
            AppConfig(gpu_memory_utilization=bad)
    gpu = yaml.safe_load((ROOT / "deploy" / "serve-cluster.yaml").read_text())["applications"][0]["args"]
    assert AppConfig(**gpu).engine_args()["gpu_memory_utilization"] == 0.9


def test_engine_deployment_options():
    from router.app import engine_deployment_options

    o = engine_deployment_options(AppConfig(tensor_parallel_size=3, num_replicas=2, cpus_per_worker=2))
    assert o["placement_group_bundles"] == [{"CPU": 2.0}] * 3 and o["placement_group_strategy"] == "STRICT_PACK"
    # The replica is TP rank 0 (workers/driver_rank.py): it reserves bundle 0's resources.
    assert o["num_replicas"] == 2 and o["ray_actor_options"] == {"num_cpus": 2.0}
    one = engine_deployment_options(AppConfig(cpus_per_worker=2))
    assert one["placement_group_bundles"] == [{"CPU": 2.0}] and one["ray_actor_options"] == {"num_cpus": 2.0}
    g = engine_deployment_options(AppConfig(device="cuda", tensor_parallel_size=2))
    assert g["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert g["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    from router.app import required_cpus

    assert required_cpus(AppConfig(tensor_parallel_size=3, num_replicas=2, cpus_per_worker=0.5)) == 6.0


def test_pipeline_stages_get_a_bundle_per_rank_packed_by_node():
    """pp stages x tp ranks: pp*tp bundles alike (stage s takes [s*tp, (s+1)*tp)), PACK so Ray puts
    each node's share together; one stage stays STRICT_PACK (one node)."""
    from router.app import engine_deployment_options, required_cpus

    cfg = AppConfig(device="cuda", tensor_parallel_size=2, pipeline_parallel_size=2, replica_resources={"big": 1})
    o = engine_deployment_options(cfg)
    assert o["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0, "big": 1}] + [{"CPU": 1.0, "GPU": 1.0}] * 3
    assert o["placement_group_strategy"] == "PACK" and o["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert cfg.world_size == 4 and cfg.engine_args()["pipeline_parallel_size"] == 2
    # pp > 1 at tp=1: a rank actor per stage, so every bundle has at least one CPU.
    two = engine_deployment_options(AppConfig(pipeline_parallel_size=2, cpus_per_worker=0.5))
    assert two["placement_group_bundles"] == [{"CPU": 1.0}] * 2 and two["placement_group_strategy"] == "PACK"
    one = engine_deployment_options(AppConfig(tensor_parallel_size=2, pipeline_parallel_size=1))
    assert len(one["placement_group_bundles"]) == 2 and one["placement_group_strategy"] == "STRICT_PACK"
    assert required_cpus(AppConfig(tensor_parallel_size=2, pipeline_parallel_size=3, num_replicas=2)) == 12.0


@pytest.mark.parametrize(
    "pp, partition, words",
    [
        (2, "14,16,1", "names 3 stages"),  # one count per stage
        (3, [10, 20], "names 2 stages"),
        (2, "14,x", "layer counts like '14,16'"),
        (2, "14.5,16", "layer counts like '14,16'"),
        (2, [14.5, 16], "valid integer"),
        (2, "0,30", "greater than 0"),
    ],
)
def test_bad_pipeline_partition_is_a_validation_error(pp, partition, words):
    with pytest.raises(ValidationError, match=words):
        AppConfig(pipeline_parallel_size=pp, pipeline_partition=partition)


def test_pipeline_partition_takes_a_string_or_a_list():
    for given in ("14,16", " 14, 16 ", [14, 16], (14, 16)):
        cfg = AppConfig(pipeline_parallel_size=2, pipeline_partition=given)
        assert cfg.pipeline_partition == (14, 16) and cfg.engine_args()["pipeline_partition"] == (14, 16)
    assert AppConfig(**cfg.model_dump()) == cfg  # the router replicas rebuild it from a dict
    assert AppConfig(pipeline_partition="").pipeline_partition is None  # an even split
    with pytest.raises(ValidationError):
        AppConfig(pipeline_parallel_size=0)


def test_cli_pipeline_flags_reach_the_engine():
    from engine.engine_args import EngineArgs
    from router.app import build_app
    from router.cli import build_parser, config_from_args

    a = build_parser().parse_args(
        ["serve", "--num-cpus", "8", "--tp", "2", "--pp", "2", "--pipeline-partition", "14,16"]
    )
    cfg = config_from_args(a)
    assert (cfg.pipeline_parallel_size, cfg.pipeline_partition) == (2, (14, 16))
    assert cfg.cpus_per_worker == 2.0  # 8 cores over 2 x 2 ranks
    (engine,) = build_app(cfg)._bound_deployment.init_args[0].values()
    kwargs = engine._bound_deployment.init_args[0]
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"], kwargs["pipeline_partition"]) == (
        2,
        2,
        (14, 16),
    )
    EngineArgs(**kwargs)  # the replica's engine takes them as they are
    placement = engine._bound_deployment._replica_config
    assert len(placement.placement_group_bundles) == 4 and placement.placement_group_strategy == "PACK"
    plain = config_from_args(build_parser().parse_args(["serve"]))
    assert (plain.pipeline_parallel_size, plain.pipeline_partition) == (1, None)


def test_engine_omp_wait_leaves_the_users_choice(monkeypatch):
    import router.serve_tuning as st

    monkeypatch.setattr(st, "USER_OMP_WAIT", False)
    got = st.engine_omp_wait({"num_cpus": 1, "runtime_env": {"env_vars": {"A": "1"}}})
    assert got == {"num_cpus": 1, "runtime_env": {"env_vars": {"GOMP_SPINCOUNT": "200000", "A": "1"}}}
    mine = {"runtime_env": {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}}
    assert st.engine_omp_wait(mine) == mine  # the engine's runtime_env says how
    monkeypatch.setattr(st, "USER_OMP_WAIT", True)  # the driver's environment said how
    assert st.engine_omp_wait({"num_cpus": 1}) == {"num_cpus": 1}


@pytest.mark.parametrize("config", ["serve.yaml", "serve-pd.yaml", "serve-pp.yaml"])
def test_serve_yaml_builds_the_app(config):
    """What `serve run deploy/<config>` does with import_path + args (no cluster needed)."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.deployment import Application

    raw = yaml.safe_load((ROOT / "deploy" / config).read_text())["applications"][0]
    app = call_user_app_builder_with_args_if_necessary(import_attr(raw["import_path"]), raw["args"])
    assert isinstance(app, Application)
    with pytest.raises(ValidationError):  # args are validated by AppConfig
        call_user_app_builder_with_args_if_necessary(import_attr(raw["import_path"]), {"tensor_parallel_size": 0})


def test_internal_errors_hide_their_details(caplog):
    from router.ingress.errors import to_api_error

    with caplog.at_level("ERROR"):
        err = to_api_error(RuntimeError("secret /etc/passwd detail"))
    assert err.status == 500 and "secret" not in err.message and "RuntimeError" not in err.message
    incident = err.message.split("incident ")[1].split(";")[0]
    assert any(incident in r.getMessage() and r.exc_info for r in caplog.records)  # the log has it all


def test_sampling_params_refuse_non_finite_numbers():
    from engine.sampling_params import SamplingParams

    for field in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        for bad in (float("nan"), float("inf"), float("-inf")):
            with pytest.raises(InvalidRequestError, match=field):
                SamplingParams(**{field: bad})


def test_retry_after_follows_the_queue(monkeypatch):
    import router.backpressure as bp

    clock = {"t": 1000.0}
    monkeypatch.setattr(bp.time, "monotonic", lambda: clock["t"])
    q = IngressQueue(4)
    for i in range(4):
        q.admit(f"r{i}")
    clock["t"] += 7.0
    with pytest.raises(OverloadedError) as e:
        q.admit("x")
    assert e.value.retry_after == 7  # nothing started yet: the oldest has waited 7 s
    for i in range(4):  # one start every 2 s: 0.5 requests/s
        clock["t"] += 2.0
        q.started(f"r{i}")
        q.admit(f"s{i}")
    with pytest.raises(OverloadedError) as e:
        q.admit("y")
    assert e.value.retry_after == 8  # 4 queued at 0.5/s


def test_disaggregated_app_has_two_pools_scaled_on_their_own():
    """prefill_replicas > 0: a prefill deployment beside the decode one (named as colocated apps
    name their engine, so routing and failover are unchanged), each with its own autoscaling
    pool from the policy file; P/D with several model pools is refused clearly."""
    from router.app import PREFILL_DEPLOYMENT, build_app
    from router.config import AppConfig
    from router.replica.deployment import EngineReplica

    cfg = AppConfig(
        prefill_replicas=1,
        prefill_tensor_parallel_size=1,
        tensor_parallel_size=3,
        num_replicas=2,
        autoscaling=str(ROOT / "deploy" / "autoscaling.yaml"),
    )
    app = build_app(cfg)
    ingress = app._bound_deployment
    decode_app, prefill_app = ingress.init_args[0][cfg.model_name], ingress.init_args[2]
    decode, prefill = decode_app._bound_deployment, prefill_app._bound_deployment
    assert decode.name == EngineReplica.name and prefill.name == PREFILL_DEPLOYMENT
    assert decode.init_args[0]["kv_transfer_config"]["role"] == "decode"
    assert decode.init_args[0]["tensor_parallel_size"] == 3
    assert prefill.init_args[0]["kv_transfer_config"]["role"] == "prefill"
    assert prefill.init_args[0]["tensor_parallel_size"] == 1
    assert decode.init_kwargs["prefill"] is prefill_app
    assert decode._deployment_config.autoscaling_config.max_replicas == 8  # `engine` (no `decode` entry)
    assert prefill._deployment_config.autoscaling_config.max_replicas == 4  # `prefill`
    with pytest.raises(ValidationError, match="disaggregated serving takes one model"):
        AppConfig(prefill_replicas=1, models=[{"name": "a"}])
