"""The autoscaling policy file (`deploy/autoscaling.yaml`): schema, loader, and translation into
Serve deployment options.

    pools:
      engine:                       # the engine replica pool (deployment `EngineReplica`)
        min_replicas: 1
        max_replicas: 8
        targets: {ongoing_requests_per_replica: 8, kv_cache_usage: 0.85, ttft_slo_s: 2.0}
        upscale_delay_s: 15
        downscale_delay_s: 120
        placement: {max_replicas_per_node: 2}

`AppConfig.autoscaling` (YAML `args`, `orbital serve --autoscaling FILE`) takes the file's path
or the same mapping inline; `build_app` calls `autoscaled(cfg, options)` which swaps the fixed
`num_replicas` for an `AutoscalingConfig` running `router.controller.autoscaling_policy:OrbitalPolicy`,
sets the drain budget (graceful shutdown) and the spread of replicas over nodes.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingConfig

    from router.config import AppConfig

POLICY_PATH = "router.controller.autoscaling_policy:OrbitalPolicy"
PROJECT_ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger(__name__)


class AutoscalingConfigError(ValueError):
    """A bad autoscaling file; the message names the file and each bad field."""


class Targets(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ongoing_requests_per_replica: float = Field(
        8.0, gt=0, description="Requests (queued + running) one replica should hold; more -> add replicas."
    )
    kv_cache_usage: float | None = Field(
        None, gt=0, le=1, description="Mean KV cache usage (0..1] to hold; above it -> add replicas. None = off."
    )
    queue_wait_s: float | None = Field(
        None, gt=0, description="Longest wait before a request is first scheduled, seconds. None = off."
    )
    ttft_slo_s: float | None = Field(
        None, gt=0, description="Time-to-first-token SLO, seconds (worst replica, recent requests). None = off."
    )
    ttft_p95_s: float | None = Field(
        None,
        gt=0,
        description="p95 time to first token to hold, seconds (worst replica, recent requests). None = off.",
    )
    itl_p95_s: float | None = Field(
        None, gt=0, description="p95 inter-token latency to hold, seconds (worst replica, recent tokens). None = off."
    )
    max_step: float = Field(
        2.0, ge=1, description="A latency/KV signal asks for at most this many times the current replicas at once."
    )


class Placement(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_replicas_per_node: int | None = Field(
        None,
        ge=1,
        le=100,
        description="Replicas of this pool on one node at most (spread). None = no limit. "
        "Every node that may host the pool must advertise `spread_resource: 1` (the cluster YAMLs do); "
        "when no node in the running cluster has it, the limit is ignored with a warning.",
    )
    spread_resource: str = Field(
        "orbital_node",
        min_length=1,
        description="Custom node resource (1 per node) that enforces the spread: "
        "each replica's first bundle takes 1/max_replicas_per_node of it.",
    )


class PoolPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(
        1,
        ge=1,
        description="Replicas kept at all times (>= 1: the router's health "
        "check and a cold model load rule out scale-to-zero).",
    )
    max_replicas: int = Field(
        1,
        ge=1,
        description="Replicas at most; past what the nodes hold, Ray's cluster "
        "autoscaler adds nodes from the `ray up` node types.",
    )
    initial_replicas: int | None = Field(None, ge=1, description="Replicas at first deploy (default min_replicas).")
    targets: Targets = Field(default_factory=Targets, description="What one replica should carry.")
    upscale_delay_s: float = Field(30.0, ge=0, description="A wish for more replicas must hold this long.")
    downscale_delay_s: float = Field(300.0, ge=0, description="A wish for fewer replicas must hold this long.")
    look_back_period_s: float = Field(30.0, gt=0, description="Window the replicas' stats are averaged over.")
    metrics_interval_s: float = Field(
        2.0,
        gt=0,
        le=60,
        description="How often replicas and callers push their "
        "stats to the Serve controller (Serve's default is 10 s).",
    )
    drain_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A replica being removed stops taking requests and "
        "finishes its running ones for at most this long (Serve's graceful shutdown).",
    )
    placement: Placement = Field(default_factory=Placement, description="Where the pool's replicas go.")

    @model_validator(mode="after")
    def _bounds(self) -> "PoolPolicy":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(
                f"look_back_period_s ({self.look_back_period_s}) must be > metrics_interval_s "
                f"({self.metrics_interval_s}): the window must hold several stats points"
            )
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(
                f"initial_replicas ({self.initial_replicas}) must lie in "
                f"[min_replicas, max_replicas] = [{self.min_replicas}, {self.max_replicas}]"
            )
        return self


class AutoscalingFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pools: dict[str, PoolPolicy] = Field(
        description="Per replica pool: `engine` (colocated replicas), `decode` and `prefill` (a disaggregated "
        "app; `decode` defaults to `engine`, a missing `prefill` keeps prefill_replicas fixed)."
    )

    @model_validator(mode="after")
    def _known_pools(self) -> "AutoscalingFile":
        unknown = sorted(set(self.pools) - set(KNOWN_POOLS))
        if unknown:
            raise ValueError(f"pools: unknown pool(s) {unknown}; known pools: {list(KNOWN_POOLS)}")
        if "engine" not in self.pools and "decode" not in self.pools:
            raise ValueError("pools: the 'engine' pool (or, disaggregated, 'decode') is required")
        return self

    def pool(self, name: str) -> PoolPolicy | None:
        """The policy of an app's pool: `engine` (colocated), `decode` (else `engine`), `prefill`."""
        if name == "engine":
            return self.pools.get("engine") or self.pools.get("decode")
        if name == "decode":
            return self.pools.get("decode") or self.pools.get("engine")
        return self.pools.get(name)


KNOWN_POOLS = ("engine", "decode", "prefill")


def _format(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        got = (
            f" (got {e['input']!r})" if e["type"] != "extra_forbidden" and not isinstance(e.get("input"), dict) else ""
        )
        msg = "unknown field (typo?)" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  {where}: {msg}{got}")
    return f"{source}: invalid autoscaling config:\n" + "\n".join(lines)


def parse_autoscaling(data: Any, source: str = "autoscaling config") -> AutoscalingFile:
    if isinstance(data, AutoscalingFile):
        return data
    if not isinstance(data, dict):
        raise AutoscalingConfigError(f"{source}: expected a mapping with `pools:`, got {type(data).__name__}")
    try:
        return AutoscalingFile.model_validate(data)
    except ValidationError as e:
        raise AutoscalingConfigError(_format(e, source)) from None


def resolve_path(path: str | os.PathLike) -> Path:
    """As given (absolute or relative to the working directory), else relative to the project."""
    p = Path(path).expanduser()
    if p.exists():
        return p
    if not p.is_absolute() and (PROJECT_ROOT / p).exists():
        return PROJECT_ROOT / p
    raise AutoscalingConfigError(
        f"autoscaling file {str(path)!r} not found (cwd {os.getcwd()}, project {PROJECT_ROOT})"
    )


def load_autoscaling(source: str | os.PathLike | dict | AutoscalingFile) -> AutoscalingFile:
    """A path to a YAML file, or the mapping itself."""
    if isinstance(source, (dict, AutoscalingFile)):
        return parse_autoscaling(source)
    path = resolve_path(source)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise AutoscalingConfigError(f"{path}: not valid YAML: {e}") from None
    return parse_autoscaling(data, str(path))


def serve_autoscaling_config(pool: PoolPolicy) -> AutoscalingConfig:
    """Serve's AutoscalingConfig for one pool (Serve keeps enforcing min/max and the delays)."""
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    t = pool.targets
    with warnings.catch_warnings():
        # In Ray 2.60 `metrics_interval_s` is still what sets how often replicas and callers push
        # their stats (the RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S variables it names as
        # successors are not read yet); it warns that it is deprecated.
        warnings.simplefilter("ignore", DeprecationWarning)
        return AutoscalingConfig(
            min_replicas=pool.min_replicas,
            max_replicas=pool.max_replicas,
            initial_replicas=pool.initial_replicas,
            target_ongoing_requests=t.ongoing_requests_per_replica,
            upscale_delay_s=pool.upscale_delay_s,
            downscale_delay_s=pool.downscale_delay_s,
            metrics_interval_s=pool.metrics_interval_s,
            look_back_period_s=pool.look_back_period_s,
            policy=AutoscalingPolicy(
                policy_function=POLICY_PATH,
                policy_kwargs={
                    "target_ongoing_requests": t.ongoing_requests_per_replica,
                    "target_kv_cache_usage": t.kv_cache_usage,
                    "target_queue_wait_s": t.queue_wait_s,
                    "ttft_slo_s": t.ttft_slo_s,
                    "ttft_p95_slo_s": t.ttft_p95_s,
                    "itl_p95_slo_s": t.itl_p95_s,
                    "max_step": t.max_step,
                },
            ),
        )


def spread_share(max_replicas_per_node: int) -> float:
    """Per-replica share of the node's spread resource, rounded down to Ray's 1e-4 resolution
    so that `max_replicas_per_node` shares always fit in 1.0."""
    return math.floor(10_000 / max_replicas_per_node) / 10_000


def _resource_missing(name: str) -> bool:
    """True when connected to Ray and no node has `name` (spreading on it would never place)."""
    import ray

    return ray.is_initialized() and name not in ray.cluster_resources()


def pool_deployment_options(pool: PoolPolicy, options: dict) -> dict:
    """Serve deployment options of a pool with a fixed size turned into an autoscaling one."""
    opts = dict(options)
    opts.pop("num_replicas", None)
    opts["autoscaling_config"] = serve_autoscaling_config(pool)
    opts["graceful_shutdown_timeout_s"] = pool.drain_timeout_s
    opts["graceful_shutdown_wait_loop_s"] = 0.5
    pl = pool.placement
    if pl.max_replicas_per_node is not None and _resource_missing(pl.spread_resource):
        log.warning(
            "placement.max_replicas_per_node=%d ignored: no node advertises the %r resource (give "
            "every node `%s: 1`, as cluster/*.yaml do); replicas are not spread",
            pl.max_replicas_per_node,
            pl.spread_resource,
            pl.spread_resource,
        )
    elif pl.max_replicas_per_node is not None:
        bundles = [dict(b) for b in opts.get("placement_group_bundles") or [{"CPU": 0.0}]]
        bundles[0][pl.spread_resource] = spread_share(pl.max_replicas_per_node)
        opts["placement_group_bundles"] = bundles
        opts.setdefault("placement_group_strategy", "STRICT_PACK")
    return opts


def autoscaled(cfg: AppConfig, engine_options: dict, pool_name: str = "engine") -> tuple[AppConfig, dict]:
    """(cfg, engine deployment options) with `cfg.autoscaling` applied; unchanged without it.

    The returned cfg carries the validated policy inline (the router replicas need no file)
    and `num_replicas = min_replicas` (the replicas the router's /health expects at least).
    """
    if cfg.autoscaling is None:
        return cfg, engine_options
    policy = load_autoscaling(cfg.autoscaling)
    pool = policy.pool(pool_name)
    if pool is None:  # e.g. no `prefill` pool in the file: that pool keeps its fixed size
        return cfg.model_copy(update={"autoscaling": None}), engine_options
    cfg = cfg.model_copy(update={"autoscaling": policy.model_dump(), "num_replicas": pool.min_replicas})
    return cfg, pool_deployment_options(pool, engine_options)
