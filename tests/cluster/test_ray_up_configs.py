"""The `ray up` configs validate under Ray's own schema (offline: prepare_config fills the
provider's defaults, validate_config checks ray-schema.json, unknown keys rejected), and mean
what cluster/README.md says they mean."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

pytest.importorskip("jsonschema")
from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ["cluster/gpu-cloud.yaml", "cluster/on-prem.yaml"]


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def validated(raw: dict) -> dict:
    cfg = prepare_config(copy.deepcopy(raw))
    validate_config(cfg)
    return cfg


@pytest.mark.parametrize("name", CONFIGS)
def test_config_validates(name):
    cfg = validated(load(name))
    assert cfg["head_start_ray_commands"][-1] == "cd ~/orbital && serve deploy deploy/serve-cluster.yaml"
    assert any("pip install -q -e ~/orbital" in c for c in cfg["setup_commands"])
    assert cfg["file_mounts"]["~/orbital"] == "."


@pytest.mark.parametrize(
    "name,where",
    [
        ("cluster/gpu-cloud.yaml", "top"),
        ("cluster/gpu-cloud.yaml", "node_type"),
        ("cluster/on-prem.yaml", "top"),
        ("cluster/on-prem.yaml", "auth"),
    ],
)
def test_typo_fails_validation(name, where):
    raw = load(name)
    if where == "top":
        raw["idle_timeout_minute"] = raw.pop("idle_timeout_minutes")
    elif where == "node_type":
        raw["available_node_types"]["gpu_tp2"]["min_worker"] = raw["available_node_types"]["gpu_tp2"].pop("min_workers")
    else:
        raw["auth"]["ssh_usr"] = raw["auth"].pop("ssh_user")
    with pytest.raises(Exception, match="Additional properties are not allowed"):
        validated(raw)


def test_gpu_cloud_node_types():
    cfg = validated(load("cluster/gpu-cloud.yaml"))
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert head["resources"]["GPU"] == 0 and head["max_workers"] == 0  # a CPU head
    gpus = {name: t["resources"]["GPU"] for name, t in types.items() if name != cfg["head_node_type"]}
    assert gpus == {"gpu_tp1": 1, "gpu_tp2": 2, "gpu_tp4": 4, "gpu_tp8": 8}
    for name, t in types.items():
        assert t["resources"]["orbital_node"] == 1, name  # the spread resource
        if name != cfg["head_node_type"]:
            assert 0 <= t["min_workers"] <= t["max_workers"] <= cfg["max_workers"]
            assert t["node_config"]["machineType"] == f"a2-highgpu-{gpus[name]}g"


def test_on_prem_uses_listed_hosts():
    raw = load("cluster/on-prem.yaml")
    cfg = validated(raw)
    assert cfg["provider"]["type"] == "local" and cfg["provider"]["head_ip"]
    node = cfg["available_node_types"]["local.cluster.node"]
    assert node["max_workers"] == raw["max_workers"] <= len(raw["provider"]["worker_ips"])
    assert node["min_workers"] == raw["min_workers"]
    for cmds in (cfg["head_start_ray_commands"], cfg["worker_start_ray_commands"]):
        assert any('"orbital_node": 1' in c for c in cmds)


def test_serve_cluster_config_loads():
    from router.config import AppConfig
    from router.controller.autoscaling_config import load_autoscaling

    args = load("deploy/serve-cluster.yaml")["applications"][0]["args"]
    cfg = AppConfig(**args)
    assert cfg.device == "cuda" and cfg.worker_gpus == 1
    pool = load_autoscaling(cfg.autoscaling).pools["engine"]
    assert pool.placement.spread_resource == "orbital_node"


@pytest.mark.parametrize("name", CONFIGS)
def test_cluster_serves_only_with_a_key(name):
    """deploy/serve-cluster.yaml binds 0.0.0.0, so it names a key file; the head makes it and
    keeps it (0600): no file mount carries it to the workers (tests/router/test_cluster_lockdown.py)."""
    serve_cfg = load("deploy/serve-cluster.yaml")
    args = serve_cfg["applications"][0]["args"]
    assert serve_cfg["http_options"]["host"] == "0.0.0.0"
    assert args.get("api_key_file") and not args.get("allow_unauthenticated")
    assert args["api_key_file"] not in validated(load(name))["file_mounts"]


def test_serve_pp_config_spans_two_gpu_tp8_nodes():
    """deploy/serve-pp.yaml: a replica of 2 stages x 8 GPUs is a PACK group of 16 GPU bundles, a
    stage per 8-GPU node; gpu-cloud's gpu_tp8 holds a stage (GPUs and CPUs) and has two nodes."""
    from router.app import engine_deployment_options
    from router.config import AppConfig

    serve_cfg = load("deploy/serve-pp.yaml")
    args = serve_cfg["applications"][0]["args"]
    cfg = AppConfig(**args)
    assert (cfg.pipeline_parallel_size, cfg.tensor_parallel_size, cfg.device) == (2, 8, "cuda")
    o = engine_deployment_options(cfg)
    bundles = o["placement_group_bundles"]
    assert len(bundles) == 16 and o["placement_group_strategy"] == "PACK"
    node = validated(load("cluster/gpu-cloud.yaml"))["available_node_types"]["gpu_tp8"]
    stage = bundles[: cfg.tensor_parallel_size]
    assert sum(b["GPU"] for b in stage) == node["resources"]["GPU"]
    assert sum(b["CPU"] for b in stage) <= node["resources"]["CPU"]
    assert node["max_workers"] >= cfg.pipeline_parallel_size * cfg.num_replicas
    # A cluster config like deploy/serve-cluster.yaml: 0.0.0.0, so a key file read on the head.
    assert serve_cfg["http_options"]["host"] == "0.0.0.0"
    assert args.get("api_key_file") and not args.get("allow_unauthenticated")
    assert args["router_resources"] == {"node:__internal_head__": 0.001}
