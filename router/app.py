"""Build the Serve application: engine replicas (a TP group per pipeline stage) behind one
router; one engine deployment per model pool (`AppConfig.models`), all behind the same router.

From Python::

    from ray import serve
    from router import AppConfig, build_app

    handle = serve.run(build_app(AppConfig(num_replicas=2)), name="orbital", route_prefix="/")
    resp = handle.completions.remote({"prompt": "Hello", "max_tokens": 8}).result()
    async for chunk in handle.options(stream=True).chat_completions.remote(
            {"messages": [{"role": "user", "content": "Hi"}], "stream": True}):
        ...

From a Serve config: `serve run deploy/serve.yaml` (import_path `router.app:app_builder`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ray.serve.config import RequestRouterConfig

from router.config import AppConfig
from router.controller.autoscaling_config import autoscaled
from router.ingress.deployment import Ingress
from router.replica.deployment import EngineReplica
from router.serve_tuning import engine_omp_wait, single_loop

if TYPE_CHECKING:
    from ray.serve import Application

ROUTING_STATS_PERIOD_S = 1.0
# Serve kills a replica it stops this long after `drain_timeout_s`: the ingress moves the requests
# left there at `drain_timeout_s` (router/ingress/drain_watch.py), the margin lets them leave.
DRAIN_MARGIN_S = 5.0


def engine_deployment_options(cfg: AppConfig) -> dict:
    """Serve options of the engine deployment: one placement group per replica, a bundle per
    rank: stage s of `pipeline_parallel_size` takes bundles [s*tp, (s+1)*tp) for its TP ranks.
    The replica actor itself reserves bundle 0 (ray_actor_options): with one rank the engine runs
    in it, with more it is rank 0 (workers/driver_rank.py), which needs its cores and GPU; the
    other ranks are Ray actors in the other bundles. One stage: STRICT_PACK (the TP group
    on one node). Several: PACK, so Ray puts each node's share of the bundles together and a
    stage that fills a node gets a node of its own."""
    # A rank actor asks for one CPU (workers.make_executor -> RayExecutor defaults), so with
    # several ranks every bundle has at least that (all bundles alike: rank 0 does the same work).
    cpus = cfg.cpus_per_worker if cfg.world_size == 1 else max(1.0, cfg.cpus_per_worker)
    bundle = {"CPU": cpus}
    actor = {"num_cpus": cpus}
    if cfg.worker_gpus:
        bundle["GPU"] = actor["num_gpus"] = cfg.worker_gpus
    bundles = [dict(bundle) for _ in range(cfg.world_size)]
    if cfg.replica_resources:  # pins the pool to nodes that advertise these resources
        bundles[0].update(cfg.replica_resources)
    if cfg.engine_runtime_env:
        actor["runtime_env"] = dict(cfg.engine_runtime_env)
    # Room for every accepted request plus control calls (finish, stats, health): the engine's
    # own queue bound answers 429 long before Serve would start queueing in the caller.
    max_ongoing = cfg.max_num_seqs + cfg.max_queued_requests_per_replica + 64
    return dict(
        num_replicas=cfg.num_replicas,
        placement_group_bundles=bundles,
        placement_group_strategy="STRICT_PACK" if cfg.pipeline_parallel_size == 1 else "PACK",
        ray_actor_options=actor,
        max_ongoing_requests=max_ongoing,
        health_check_period_s=10.0,
        health_check_timeout_s=30.0,
        # Every removal drains (fixed size, redeploy, autoscaling alike): no new requests, the
        # running ones finish or move (drain_watch.py) before Serve kills it.
        graceful_shutdown_timeout_s=cfg.drain_timeout_s + DRAIN_MARGIN_S,
        graceful_shutdown_wait_loop_s=0.5,
        # Its callers are the routers (submit, stats, the 2 s KV-event long poll): an access
        # line per call buried the log; the ingress keeps the access log of client requests.
        logging_config={"enable_access_log": False},
        request_router_config=RequestRouterConfig(
            request_router_class="router.replica_choice.request_router:EngineRequestRouter",
            request_router_kwargs=routing_kwargs(cfg),
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=5.0,
        ),
    )


def routing_kwargs(cfg: AppConfig) -> dict:
    """What the replica choice needs to compute a prompt's block hashes as the engines do."""
    policy = cfg.routing
    if policy == "cache-aware" and not cfg.enable_prefix_caching:
        policy = "least-loaded"  # nothing to find: engines publish no blocks
    return {
        "policy": policy,
        "block_size": cfg.block_size,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "peer_fetch": cfg.kv_peer_fetch,
    }


def engine_deployment_names(cfg: AppConfig) -> list[str]:
    """The engine deployment of each pool, in `cfg.pool_configs()` order: `EngineReplica` for the
    one pool of `models=None` (as always), else `EngineReplica-<pool name>` (characters Serve or
    a shell could trip on replaced by `_`; a clash gets a `-<index>` suffix)."""
    if cfg.models is None:
        return [EngineReplica.name]
    names: list[str] = []
    for i, pool in enumerate(cfg.models):
        name = f"{EngineReplica.name}-{re.sub(r'[^A-Za-z0-9_.-]', '_', pool.name)}"
        names.append(f"{name}-{i}" if name in names else name)
    return names


def required_cpus(cfg: AppConfig) -> float:
    """Logical CPUs the app reserves (every pool's engine placement groups at its num_replicas,
    and the router)."""
    total = 0.0
    for pool in cfg.pool_configs():
        o = engine_deployment_options(pool)
        total += pool.num_replicas * sum(b.get("CPU", 0) for b in o["placement_group_bundles"])
    return total + cfg.router_replicas * cfg.router_cpus


def build_app(cfg: AppConfig | dict | None = None) -> Application:
    """The Serve Application (pass it to `serve.run`)."""
    if cfg is None:
        cfg = AppConfig()
    elif isinstance(cfg, dict):
        cfg = AppConfig(**cfg)
    if cfg.disaggregated:
        return _build_disaggregated(cfg)
    engines, pools = {}, []
    for name, pool in zip(engine_deployment_names(cfg), cfg.pool_configs()):
        pool, engine = _engine_deployment(pool, name, cfg)
        engines[pool.model_name] = engine
        pools.append(pool)
    if cfg.models is None:
        cfg = pools[0]  # autoscaled: num_replicas is what the router's /health expects
    else:
        models = [m.model_copy(update={"num_replicas": p.num_replicas}) for m, p in zip(cfg.models, pools)]
        cfg = cfg.model_copy(
            update={"models": models, "autoscaling": pools[0].autoscaling, "drain_timeout_s": pools[0].drain_timeout_s}
        )
    # The config travels as the ingress's init arguments (Ray's metadata): it names the key file
    # or variable, which the replica reads itself; only a literal `api_key` is in it.
    return _ingress(cfg, pools).bind(engines, cfg.model_dump())


def _engine_deployment(
    pool: AppConfig, name: str, cfg: AppConfig, pool_name: str = "engine", kv_role: str = "decode", **bind_kwargs: Any
) -> tuple[AppConfig, Application]:
    """One pool's EngineReplica deployment `name`: its options with the autoscaling policy's
    `pool_name` pool applied (a no-op without `autoscaling`), bound to the pool's engine args
    for `kv_role` and `bind_kwargs`. Returns the pool's config as deployed (autoscaled: its
    `num_replicas` and drain budget) and the bound deployment."""
    pool, options = autoscaled(pool, engine_deployment_options(pool), pool_name=pool_name)
    if pool.autoscaling is not None:
        # The policy's drain budget is Serve's kill deadline: the ingress moves what is left
        # a margin before it.
        drain = max(1.0, options["graceful_shutdown_timeout_s"] - DRAIN_MARGIN_S)
        pool = pool.model_copy(update={"drain_timeout_s": drain})
    options["ray_actor_options"] = engine_omp_wait(single_loop(options["ray_actor_options"]))
    app = EngineReplica.options(name=name, **options).bind(
        pool.engine_args(kv_role),
        pool.max_queued_requests_per_replica,
        cfg.stuck_step_timeout_s,
        router_lease_s=cfg.router_lease_s,
        otlp_traces_endpoint=cfg.otlp_traces_endpoint,
        **bind_kwargs,
    )
    return pool, app


PREFILL_DEPLOYMENT = f"{EngineReplica.name}-prefill"


def _build_disaggregated(cfg: AppConfig) -> Application:
    """Prefill pool + decode pool (the `EngineReplica` deployment, as colocated apps name it,
    so routing, failover and /health work unchanged) behind one router. Decode first: the
    router picks a decode replica; it asks a prefill replica for the KV of long prompts."""
    # Of the prefill pool's config as deployed only num_replicas is used: the drain budget is
    # the ingress's, which drains the decode pool.
    prefill_cfg, prefill = _engine_deployment(
        cfg.prefill_pool_config(), PREFILL_DEPLOYMENT, cfg, pool_name="prefill", kv_role="prefill"
    )
    decode_cfg, decode = _engine_deployment(
        cfg,
        EngineReplica.name,
        cfg,
        pool_name="decode",
        prefill=prefill,
        kv_transfer_failure=cfg.kv_transfer_failure,
        kv_transfer_timeout_s=cfg.kv_transfer_timeout_s,
    )
    decode_cfg = decode_cfg.model_copy(update={"prefill_replicas": prefill_cfg.num_replicas})
    return _ingress(decode_cfg, [decode_cfg]).bind({decode_cfg.model_name: decode}, decode_cfg.model_dump(), prefill)


def _ingress(cfg: AppConfig, pools: list[AppConfig]):
    actor: dict[str, Any] = {"num_cpus": cfg.router_cpus}
    if cfg.router_resources:  # e.g. the head: where a cluster keeps the key file
        actor["resources"] = dict(cfg.router_resources)
    return Ingress.options(
        num_replicas=cfg.router_replicas,
        ray_actor_options=single_loop(actor),
        max_ongoing_requests=max(1000, 4 * sum(p.max_queued_requests for p in pools)),
        max_queued_requests=cfg.max_waiting_connections,  # past the ongoing limit: refused, not held
        # A redeploy replaces the router too. The old one takes no new requests but relays its
        # open streams to the end (their engine requests run, or move, elsewhere): a stream may
        # last up to the request deadline. Serve stops it as soon as they are done.
        graceful_shutdown_timeout_s=max(cfg.request_timeout_s, cfg.drain_timeout_s) + 2 * DRAIN_MARGIN_S,
        graceful_shutdown_wait_loop_s=0.5,
    )


def app_builder(args: AppConfig) -> Application:
    """Application builder for `serve run` / Serve config files (args validated by AppConfig)."""
    return build_app(args)
