"""The cluster is locked down: every `ray start` of both `ray up` configs runs with Ray's token
authentication, the token is made on the head and reaches workers only from there, the API key
file lives on the head only (owner-only), the routers are pinned to the head, and the key never
sits in Ray's metadata (the app's deployment arguments) when it comes from a file or a variable.
No Ray cluster: configs are parsed, the app is built as `serve.run` builds it, not deployed."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from router.config import AppConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ["cluster/gpu-cloud.yaml", "cluster/on-prem.yaml"]
TOKEN_PATH = "~/.ray/auth_token"
HEAD_RESOURCE = "node:__internal_head__"  # Ray's own resource of the head node


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def cluster_args() -> dict:
    return load("deploy/serve-cluster.yaml")["applications"][0]["args"]


def ray_starts(cfg: dict, key: str) -> list[str]:
    cmds = [c for c in cfg[key] if re.search(r"\bray start\b", c)]
    assert cmds, f"{key}: no `ray start`"
    return cmds


@pytest.mark.parametrize("name", CONFIGS)
def test_every_ray_start_and_driver_uses_token_auth(name):
    cfg = load(name)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for cmd in ray_starts(cfg, key):
            before = cmd[: re.search(r"\bray start\b", cmd).start()]  # env assignments precede it
            assert re.search(r"(^|[\s;])RAY_AUTH_MODE=token\s", before), f"{key}: {cmd}"
            assert "RAY_AUTH_TOKEN_PATH=$HOME/.ray/auth_token" in before, f"{key}: {cmd}"
    # Drivers (serve deploy, `ray exec`): Ray sources ~/.bashrc before each command on every node.
    exports = [c for c in cfg["setup_commands"] if "RAY_AUTH_MODE" in c]
    assert len(exports) == 1 and ">> ~/.bashrc" in exports[0], exports
    assert "RAY_AUTH_MODE=token" in exports[0] and 'RAY_AUTH_TOKEN_PATH="$HOME/.ray/auth_token"' in exports[0]
    # Made once on the head, owner-only; workers get it from the head, never from file_mounts.
    made = [c for c in cfg["head_setup_commands"] if f"> {TOKEN_PATH}" in c]
    assert len(made) == 1 and "umask 077" in made[0] and "/dev/urandom" in made[0], made
    assert f"test -s {TOKEN_PATH} ||" in made[0]  # a re-run of `ray up` keeps the workers' token
    assert cfg["cluster_synced_files"] == [TOKEN_PATH]
    assert not any(".ray" in k or ".ray" in str(v) for k, v in cfg["file_mounts"].items())
    assert "--dashboard-host=127.0.0.1" in ray_starts(cfg, "head_start_ray_commands")[0]


@pytest.mark.parametrize("name", CONFIGS)
def test_api_key_file_is_on_the_head_only(name):
    cfg = load(name)
    key_file = cluster_args()["api_key_file"]
    mounted = {**cfg["file_mounts"], **{p: p for p in cfg.get("cluster_synced_files", [])}}
    assert not any("api-key" in k or "api-key" in str(v) for k, v in mounted.items()), mounted
    assert key_file not in mounted
    made = [c for c in cfg["head_setup_commands"] if f"> {key_file}" in c]
    assert len(made) == 1 and "umask 077" in made[0] and f"chmod 600 {key_file}" in made[0], made
    assert not any(key_file in c for c in cfg["worker_setup_commands"] + cfg["setup_commands"])


def _built(cfg: AppConfig):
    """The deployments as Serve ships them to its controller (what `serve.run` builds first)."""
    pytest.importorskip("ray")
    from ray.serve._private.build_app import build_app as serve_build  # what serve.run calls

    from router.app import app_builder

    return serve_build(app_builder(cfg), name="orbital").deployments


def _leaks(deployments, key: str) -> list[str]:
    from ray import cloudpickle

    out = []
    for d in deployments:
        args = (d.init_args, d.init_kwargs, d.ray_actor_options)
        if key in repr(args) or key.encode() in cloudpickle.dumps(args):
            out.append(d.name)
    return out


def _ingress(deployments):
    (ingress,) = [d for d in deployments if d.name == "Ingress"]
    return ingress


def test_cluster_app_key_file_stays_out_of_ray_metadata(tmp_path, monkeypatch):
    """deploy/serve-cluster.yaml as the head deploys it: routers pinned to the head, where the
    key file is; the replica reads the file, the deployment arguments hold only its path."""
    monkeypatch.delenv("ORBITAL_API_KEY", raising=False)
    key = "file-key-7f3a9c"
    path = tmp_path / "api-key"
    path.write_text(key + "\n")
    deployments = _built(AppConfig(**{**cluster_args(), "api_key_file": str(path)}))
    assert _leaks(deployments, key) == []
    ingress = _ingress(deployments)
    assert ingress.ray_actor_options["resources"] == {HEAD_RESOURCE: 0.001}
    replica_cfg = AppConfig(**ingress.init_args[1])  # what the replica constructs
    assert replica_cfg.api_key is None and replica_cfg.resolve_api_key() == key


def test_env_key_is_read_in_the_replica_not_shipped(monkeypatch):
    key = "env-key-51c0de"
    monkeypatch.setenv("ORBITAL_API_KEY", key)
    deployments = _built(AppConfig())
    assert _leaks(deployments, key) == []
    config = _ingress(deployments).init_args[1]
    assert config["api_key"] is None and config["api_key_env"] == "ORBITAL_API_KEY"
    assert AppConfig(**config).resolve_api_key() == key  # a replica that has the variable
    # One that lacks it refuses to start rather than serving without the key it was given.
    monkeypatch.delenv("ORBITAL_API_KEY")
    with pytest.raises(PermissionError, match=r"\$ORBITAL_API_KEY is not set"):
        AppConfig(**config).resolve_api_key()


def test_literal_api_key_still_works(monkeypatch):
    """A key written into the config is the caller's choice: it travels, and it is the key."""
    monkeypatch.setenv("ORBITAL_API_KEY", "ignored-env-key")
    cfg = AppConfig(api_key="literal-key")
    assert cfg.api_key_env is None and cfg.resolve_api_key() == "literal-key"
    config = _ingress(_built(cfg)).init_args[1]
    assert AppConfig(**config).resolve_api_key() == "literal-key"
    assert os.environ["ORBITAL_API_KEY"] == "ignored-env-key"
