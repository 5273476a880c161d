"""`orbital serve`: start a local Ray cluster and serve a model over HTTP until Ctrl-C.

    orbital serve                      # the embedded SmolLM2-135M-Instruct on 127.0.0.1:8000
    orbital serve --model ./my-llama --tp 2 --replicas 2 --port 8080 --api-key secret
    orbital serve --address auto --device cuda --model /models/big --pp 2 --tp 8   # a stage per node
    orbital serve --autoscaling deploy/autoscaling.yaml   # 1..max replicas, by load
    orbital serve --model-pool name=small,replicas=2 --model-pool name=big,model=./llama,tp=2 \
                  --alias chat=small,big                  # two models, a tier that overflows

(`python -m router.cli serve ...` does the same without the console script.)
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

from engine import choices
from engine.kv_offload.flags import add_offload_flags
from engine.layers.quant.spec import METHODS
from engine.lora.config import add_lora_flags, parse_lora_modules

if TYPE_CHECKING:
    from router.config import AppConfig


def _d(field: str):
    """AppConfig's default for a flag (defaults live in one place)."""
    from router.config import AppConfig

    return AppConfig.model_fields[field].default


def _peer_fetch_modes() -> tuple[str, ...]:
    from router.replica_choice.peer_fetch_plan import MODES

    return MODES


def _reasoning_parsers() -> tuple[str, ...]:
    from router.config import REASONING_PARSERS

    return REASONING_PARSERS


# Short keys of --model-pool beside ModelPool's own field names (with - or _).
POOL_KEYS = {"replicas": "num_replicas", "tp": "tensor_parallel_size", "pp": "pipeline_parallel_size"}


def parse_model_pool(spec: str) -> dict:
    """`name=NAME,model=PATH,dtype=...,replicas=N,tp=N,pp=N,max-num-seqs=N,...` -> a ModelPool
    mapping (values stay strings; AppConfig validates them). `pipeline-partition=14,16` keeps its
    commas: the items after it without `=` are the rest of its value."""
    from router.config import ModelPool

    out: dict[str, str] = {}
    key = None
    for item in filter(None, (x.strip() for x in spec.split(","))):
        if key == "pipeline_partition" and "=" not in item:
            out[key] += f",{item}"
            continue
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        key = POOL_KEYS.get(key, key)
        if not eq or key not in ModelPool.model_fields:
            known = sorted(set(ModelPool.model_fields) | set(POOL_KEYS))
            raise argparse.ArgumentTypeError(f"{item!r}: expected KEY=VALUE with KEY one of {known}")
        out[key] = value.strip()
    if not out.get("name"):
        raise argparse.ArgumentTypeError(f"{spec!r}: name=NAME is required")
    return out


def parse_alias(spec: str) -> tuple[str, list[str]]:
    """`NAME=pool1,pool2` -> (NAME, [pool1, pool2])."""
    name, eq, pools = spec.partition("=")
    tier = [p.strip() for p in pools.split(",") if p.strip()]
    if not eq or not name.strip() or not tier:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=pool1,pool2,...")
    return name.strip(), tier


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orbital", description="Orbital: distributed LLM serving on Ray.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model (OpenAI + TGI HTTP) until Ctrl-C")
    s.add_argument(
        "--model", default=None, help="local HF directory or .gguf (default: embedded SmolLM2-135M-Instruct)"
    )
    s.add_argument("--served-model-name", default=None)
    s.add_argument(
        "--tp",
        "--tensor-parallel-size",
        "--decode-tp",
        dest="tp",
        type=int,
        default=_d("tensor_parallel_size"),
        help="workers per engine replica (disaggregated: per decode replica)",
    )
    s.add_argument(
        "--pp",
        "--pipeline-parallel-size",
        "--decode-pp",
        dest="pp",
        type=int,
        default=_d("pipeline_parallel_size"),
        help="pipeline stages per engine replica: the model's layers in contiguous stages of --tp workers each, "
        "a stage per node for a model bigger than one node (disaggregated: per decode replica)",
    )
    s.add_argument(
        "--pipeline-partition",
        default=_d("pipeline_partition"),
        metavar="N,N,...",
        help="layers per stage, e.g. 14,16 (default: as even as the layer count allows)",
    )
    s.add_argument(
        "--replicas",
        "--decode-replicas",
        dest="replicas",
        type=int,
        default=_d("num_replicas"),
        help="engine replicas (disaggregated: decode replicas)",
    )
    s.add_argument(
        "--prefill-replicas",
        type=int,
        default=_d("prefill_replicas"),
        help="prefill pool replicas: > 0 serves disaggregated (decode replicas get long prompts' KV from it)",
    )
    s.add_argument("--prefill-tp", type=int, default=None, help="workers per prefill replica (default: --tp)")
    s.add_argument("--prefill-pp", type=int, default=None, help="pipeline stages per prefill replica (default: --pp)")
    s.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=_d("local_prefill_max_tokens"),
        help="disaggregated: uncached prompt suffixes up to this long are prefilled on the decode replica",
    )
    s.add_argument(
        "--kv-transfer-failure",
        choices=["recompute", "fail"],
        default=_d("kv_transfer_failure"),
        help="disaggregated: a failed remote prefill is recomputed on the decode replica, or fails the request",
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    # No default from $ORBITAL_API_KEY here: AppConfig keeps only the variable's name, and the
    # ingress replica reads it, so the key stays out of Ray's deployment arguments.
    s.add_argument("--api-key", default=None, help="bearer key (default: $ORBITAL_API_KEY, read by the router)")
    s.add_argument("--api-key-file", default=None, help="file holding the bearer key")
    s.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve without a key on a non-loopback --host (refused otherwise)",
    )
    s.add_argument("--dtype", default=_d("dtype"), choices=list(choices.DTYPES))
    s.add_argument(
        "--quantization",
        default=_d("quantization"),
        choices=list(METHODS),
        help="weight-only: int8, int4[:g32|g64|g128] at load, or gguf (a GGUF's own blocks)",
    )
    s.add_argument(
        "--int8-activations",
        action="store_true",
        default=_d("int8_activations"),
        help="CPU, with quantization: activations rounded to int8 per group for integer dot products (llama.cpp's arithmetic; AVX-512 VNNI)",
    )
    s.add_argument(
        "--kv-cache-dtype",
        default=_d("kv_cache_dtype"),
        choices=list(choices.KV_CACHE_DTYPES),
        help="KV cache storage: the model's dtype, or int8/fp8_e4m3 (GPU) with per-token scales (~2x the tokens of bf16)",
    )
    s.add_argument("--device", default=_d("device"))
    s.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache per replica (default: 1 GiB on CPU; on CUDA sized by --gpu-memory-utilization)",
    )
    s.add_argument("--gpu-memory-utilization", type=float, default=_d("gpu_memory_utilization"))
    add_offload_flags(s, _d)
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--max-num-seqs", type=int, default=_d("max_num_seqs"))
    s.add_argument("--max-num-batched-tokens", type=int, default=_d("max_num_batched_tokens"))
    s.add_argument(
        "--scheduling-policy",
        choices=list(choices.SCHEDULING_POLICIES),
        default=_d("scheduling_policy"),
        help="request order",
    )
    s.add_argument("--no-prefix-caching", action="store_true")
    s.add_argument(
        "--speculative",
        default=_d("speculative"),
        help="speculative decoding: ngram:k, self:k (the model's own weights in int8 as draft) or "
        "draft:k:/local/draft-model (draft length adapts per request and load)",
    )
    s.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: all cores / replicas)")
    add_lora_flags(s, _d)
    s.add_argument(
        "--spare-core-max-tokens",
        type=int,
        default=_d("spare_core_max_tokens"),
        help="CPU: steps of at most this many tokens run on one thread fewer, leaving a core to the processes "
        "that stream tokens out (0: never)",
    )
    s.add_argument(
        "--no-warmup", action="store_true", help="replicas report ready without building their kernels first"
    )
    s.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may use (default: all)")
    s.add_argument(
        "--address",
        default="local",
        help="Ray cluster: 'local' starts one (default), 'auto' or host:port joins a running one",
    )
    s.add_argument(
        "--serve-proxy",
        action="store_true",
        help="local cluster: relay HTTP through Serve's proxy actor instead of the router replica serving "
        "the port itself (router/direct_ingress.py); a joined cluster (--address) always uses its proxies",
    )
    s.add_argument(
        "--max-queued-requests", type=int, default=_d("max_queued_requests"), help="per router replica; past it 429"
    )
    s.add_argument(
        "--routing",
        default=_d("routing"),
        choices=["cache-aware", "least-loaded", "round-robin"],
        help="engine replica choice (cache-aware: the replica holding most of the prompt's KV blocks)",
    )
    s.add_argument(
        "--kv-peer-fetch",
        default=_d("kv_peer_fetch"),
        choices=list(_peer_fetch_modes()),
        help="cache-aware routing: a request sent away from the replica holding its prefix fetches the prefix's "
        "KV from it (auto: when estimated cheaper than recomputing; always; off)",
    )
    s.add_argument("--max-queued-requests-per-replica", type=int, default=_d("max_queued_requests_per_replica"))
    s.add_argument("--request-timeout-s", type=float, default=_d("request_timeout_s"))
    s.add_argument(
        "--tool-call-parser",
        default=_d("tool_call_parser"),
        choices=["hermes", "llama3_json"],
        help="the model's tool-call syntax, for tool_choice 'auto' (without one: a 400)",
    )
    s.add_argument(
        "--reasoning-parser",
        default=_d("reasoning_parser"),
        choices=list(_reasoning_parsers()),
        help="the model's <think> blocks: chat completions return them as reasoning_content, apart from content",
    )
    s.add_argument(
        "--pooling-type",
        default=_d("pooling_type"),
        choices=list(choices.POOLING_TYPES),
        help="/v1/embeddings: the last input token's final hidden state, or the mean over the input",
    )
    s.add_argument(
        "--max-migrations",
        type=int,
        default=_d("max_migrations"),
        help="moves of one request to another replica when its replica dies or drains (0: never)",
    )
    s.add_argument(
        "--drain-timeout-s",
        type=float,
        default=_d("drain_timeout_s"),
        help="a replica being removed finishes its requests for this long; the rest move elsewhere",
    )
    s.add_argument("--max-request-body-bytes", type=int, default=_d("max_request_body_bytes"))
    s.add_argument(
        "--otlp-traces-endpoint",
        default=_d("otlp_traces_endpoint"),
        metavar="URL",
        help="send OpenTelemetry traces of each request's path over OTLP/HTTP to this URL, e.g. "
        "http://localhost:4318/v1/traces (default: the OTEL_EXPORTER_OTLP_* variables; none: off)",
    )
    s.add_argument(
        "--autoscaling",
        default=None,
        metavar="YAML",
        help="autoscaling policy file (deploy/autoscaling.yaml); replaces --replicas",
    )
    s.add_argument(
        "--model-pool",
        dest="model_pools",
        action="append",
        type=parse_model_pool,
        default=None,
        metavar="name=NAME,model=PATH,...",
        help="serve several models: one engine deployment per pool (repeat the flag); keys: name (required, "
        "what clients pass as `model`), model, dtype, replicas, tp, pp, pipeline-partition (its commas stay "
        "in its value: pp=2,pipeline-partition=14,16), kv-cache-memory-bytes, max-model-len, "
        "max-num-seqs, max-num-batched-tokens, max-queued-requests-per-replica, max-queued-requests; a key left "
        "out takes the flag's value. The first pool answers requests that name no model (and TGI routes).",
    )
    s.add_argument(
        "--alias",
        dest="aliases",
        action="append",
        type=parse_alias,
        default=None,
        metavar="NAME=pool1,pool2",
        help="a model name for an ordered list of pools (a tier): requests go to the first and move to the "
        "next only when it sheds load (429); repeatable",
    )
    return p


def config_from_args(a: argparse.Namespace) -> AppConfig:
    from router.config import AppConfig

    cores = a.num_cpus or os.cpu_count() or 1
    pools = getattr(a, "model_pools", None)
    # (replicas, ranks per replica: tp x pp) of each pool
    replicas_ranks = [
        (
            int(p.get("num_replicas") or a.replicas),
            int(p.get("tensor_parallel_size") or a.tp) * int(p.get("pipeline_parallel_size") or a.pp),
        )
        for p in pools or [{}]
    ]
    if a.prefill_replicas:
        replicas_ranks.append((a.prefill_replicas, (a.prefill_tp or a.tp) * (a.prefill_pp or a.pp)))
    workers = sum(r * n for r, n in replicas_ranks)
    if getattr(a, "autoscaling", None):  # size CPUs for the most replicas the policy may start
        from router.controller.autoscaling_config import load_autoscaling

        most = load_autoscaling(a.autoscaling).pool("engine").max_replicas
        engine_pools = replicas_ranks[:-1] if a.prefill_replicas else replicas_ranks  # the prefill pool stays fixed
        workers = sum(most * n for _, n in engine_pools) + sum(r * n for r, n in replicas_ranks[len(engine_pools) :])
    cpus = max(1.0, cores // workers) if cores >= workers else cores / workers
    return AppConfig(
        model=a.model,
        served_model_name=a.served_model_name,
        dtype=a.dtype,
        quantization=a.quantization,
        int8_activations=a.int8_activations,
        kv_cache_dtype=a.kv_cache_dtype,
        device=a.device,
        tensor_parallel_size=a.tp,
        pipeline_parallel_size=a.pp,
        pipeline_partition=a.pipeline_partition,
        num_replicas=a.replicas,
        prefill_replicas=a.prefill_replicas,
        prefill_tensor_parallel_size=a.prefill_tp,
        prefill_pipeline_parallel_size=a.prefill_pp,
        local_prefill_max_tokens=a.local_prefill_max_tokens,
        kv_transfer_failure=a.kv_transfer_failure,
        kv_cache_memory_bytes=a.kv_cache_memory_bytes,
        gpu_memory_utilization=a.gpu_memory_utilization,
        kv_offload_bytes=a.kv_offload_bytes,
        kv_offload_medium=a.kv_offload_medium,
        kv_offload_dir=a.kv_offload_dir,
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        scheduling_policy=a.scheduling_policy,
        max_num_batched_tokens=a.max_num_batched_tokens,
        enable_prefix_caching=not a.no_prefix_caching,
        speculative=a.speculative,
        num_threads=a.threads or max(1, int(cpus)),
        spare_core_max_tokens=a.spare_core_max_tokens,
        warmup=not a.no_warmup,
        enable_lora=a.enable_lora,
        max_loras=a.max_loras,
        max_lora_rank=a.max_lora_rank,
        max_cpu_loras=a.max_cpu_loras,
        lora_modules=parse_lora_modules(a.lora_modules) or None,
        cpus_per_worker=cpus,
        max_queued_requests=a.max_queued_requests,
        routing=a.routing,
        kv_peer_fetch=a.kv_peer_fetch,
        max_queued_requests_per_replica=a.max_queued_requests_per_replica,
        request_timeout_s=a.request_timeout_s,
        tool_call_parser=a.tool_call_parser,
        reasoning_parser=a.reasoning_parser,
        pooling_type=a.pooling_type,
        max_migrations=a.max_migrations,
        drain_timeout_s=a.drain_timeout_s,
        max_request_body_bytes=a.max_request_body_bytes,
        otlp_traces_endpoint=a.otlp_traces_endpoint,
        api_key=a.api_key,
        api_key_file=a.api_key_file,
        allow_unauthenticated=a.allow_unauthenticated,
        autoscaling=getattr(a, "autoscaling", None),
        models=pools,
        aliases=dict(getattr(a, "aliases", None) or []),
    )


def serve_forever(a: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from router.app import build_app
    from router.ingress.public_bind import check_public_bind

    try:
        cfg = config_from_args(a)
        check_public_bind(cfg, a.host)
    except (PermissionError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    http_port = a.port
    if a.address == "local":  # a fresh local cluster, even if `ray start` left one running here
        from router.app import required_cpus
        from router.direct_ingress import direct_ingress_env, port_free, spare_port

        if not port_free(a.host, a.port):
            print(f"error: {a.host}:{a.port} is in use (another server?); pick one with --port", file=sys.stderr)
            return 2
        if not a.serve_proxy:  # Ray reads these in the processes ray.init starts below
            os.environ.update(direct_ingress_env(a.port))
            http_port = spare_port(a.host)  # Serve's proxy, off the user's port
        num_cpus = max(a.num_cpus or os.cpu_count() or 1, math.ceil(required_cpus(cfg)))
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, configure_logging=False)
    else:
        ray.init(address=a.address, configure_logging=False)
    try:
        serve.start(http_options={"host": a.host, "port": http_port})
        serve.run(build_app(cfg), name="orbital", route_prefix="/")
        url = f"http://{a.host}:{a.port}"
        names = ", ".join([p.model_name for p in cfg.pool_configs()] + [f"{k} -> {v}" for k, v in cfg.aliases.items()])
        print(
            f"Orbital is serving {names} at {url}  (OpenAI: {url}/v1, TGI: {url}/generate, "
            f"metrics: {url}/metrics). Ctrl-C stops it.",
            flush=True,
        )
        stop = {"now": False}
        # SIGINT is handled explicitly too: a parent that ignores it (nohup, some supervisors,
        # a test runner) passes SIG_IGN on, and Python then never raises KeyboardInterrupt.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.update(now=True))
        while not stop["now"]:
            time.sleep(0.5)
    except KeyboardInterrupt:  # Ctrl-C during start-up, before the handlers are in place
        pass
    finally:
        print("shutting down...", flush=True)
        try:
            # On a cluster others share, Serve drains the app. A local cluster is this process's
            # own and goes with it: Serve's shutdown waited out the engines' drain budget there
            # (the routers' KV-event long polls keep them busy) and Ctrl-C took 35 s.
            if a.address != "local":
                serve.shutdown()
        finally:
            ray.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.command == "serve":
        return serve_forever(a)
    return 2


if __name__ == "__main__":
    sys.exit(main())
