"""AppConfig: everything a deployment sets (YAML `args`, CLI flags, Python), one pydantic model.

`engine_args()` builds the engine's EngineArgs fields from it: one function turns the outer
config into the inner one, and every engine default is EngineArgs' own (`_E`), never repeated.

Several models behind one endpoint: `models` lists `ModelPool`s (one engine deployment each),
`aliases` names ordered lists of pools (tiers). `pool_configs()` is the one merge: each pool's
fields over the top-level ones, as a complete AppConfig per pool, so every default and bound
stays written once, here.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from engine import choices
from engine.config import ParallelConfig
from engine.engine_args import EngineArgs as _E
from engine.pipeline import parse_partition
from engine.watermark import Watermark
from router.replica_choice.peer_fetch_plan import MODES as PEER_FETCH_MODES
from router.tiering.settings import TierRouting

ENV_KEY = "ORBITAL_API_KEY"  # the bearer key's default environment variable
# `<think>` block parsers of chat outputs (router/ingress/reasoning_parsers.py), vLLM's names
REASONING_PARSERS = ("deepseek_r1", "qwen3")


class ModelPool(BaseModel):
    """One served model: its own engine deployment, tokenizer and queues. A field left out (or
    null) takes the top-level AppConfig value; AppConfig validates the merged result
    (`AppConfig.pool_configs()`), so the bounds and defaults are AppConfig's own. To serve the
    embedded model in a pool while the top-level `model` names another, write `model: default`.
    A pool that sets `pipeline_parallel_size` but no `pipeline_partition` splits its layers
    evenly (the top-level partition belongs to the top-level stage count)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    name: str = Field(min_length=1, description="The served name: what clients pass as `model`.")
    model: str | None = Field(None, description="Local HF directory or .gguf file; `default` = embedded.")
    dtype: str | None = None  # checked as AppConfig.dtype when the pool is merged (pool_configs)
    quantization: str | None = None  # likewise: a cheaper tier of the same checkpoint (int8, int4:g32, gguf)
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    pipeline_partition: tuple[int, ...] | str | None = None  # "14,16" or [14, 16]; checked when merged
    num_replicas: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_queued_requests_per_replica: int | None = None
    max_queued_requests: int | None = Field(None, description="This pool's queue bound in each router replica.")
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    pooling_type: str | None = None

    def overrides(self) -> dict:
        """The AppConfig fields this pool sets (its served name included)."""
        fields = self.model_dump(exclude={"name"}, exclude_none=True)
        if "pipeline_parallel_size" in fields:
            fields.setdefault("pipeline_partition", None)
        return {**fields, "served_model_name": self.name}


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # --- the model and the engine ---
    model: str | None = Field(
        None, description="Local HF directory or .gguf file; None = embedded SmolLM2-135M-Instruct."
    )
    served_model_name: str | None = Field(
        None, description="Name clients pass as `model` (default: from the path; with `models`: each pool's name)."
    )
    dtype: Literal[choices.DTYPES] = Field(_E.dtype, description="auto | float32 | bfloat16 | float16.")
    quantization: Literal[choices.QUANTIZATION_METHODS] | None = Field(
        _E.quantization,
        description="Weight-only quantization: int8 (per output channel) or int4 (group-wise, :gN the group "
        "size) quantized at load; gguf: a GGUF model's own blocks (K-quants included) as they are; gptq / awq: the checkpoint's own integers (None takes them from its quantization_config); None: float.",
    )
    int8_activations: bool = Field(
        _E.int8_activations,
        description="CPU, with quantization: the quantized linears round each activation row to int8 per group "
        "and multiply with integer dot products, as llama.cpp does (AVX-512 VNNI, VBMI and BITALG: AMD Zen 4, "
        "Intel Ice Lake or later; refused elsewhere). Faster batched steps; logits within that rounding.",
    )
    kv_cache_dtype: Literal[choices.KV_CACHE_DTYPES] = Field(
        _E.kv_cache_dtype,
        description="KV cache storage: auto (the model's dtype), int8 (per-token, per-head scales; about 1.9x "
        "the tokens of bfloat16, 3.9x of float32, in the same memory) or fp8_e4m3 (the same, as fp8; GPUs with "
        "compute capability 8.9+).",
    )
    device: str = Field(_E.device, description="cpu | cuda.")
    tensor_parallel_size: int = Field(
        _E.tensor_parallel_size, ge=1, description="Workers per engine replica (a TP group)."
    )
    pipeline_parallel_size: int = Field(
        _E.pipeline_parallel_size,
        ge=1,
        description="Pipeline stages per engine replica: the model's layers split into this many contiguous "
        "stages, each a tensor_parallel_size group (a stage per node, for models bigger than one node).",
    )
    pipeline_partition: tuple[PositiveInt, ...] | None = Field(
        _E.pipeline_partition,
        description="Layers per stage, '14,16' or [14, 16]: one count per stage, summing to the model's layers "
        "(None: as even as the layer count allows).",
    )
    num_replicas: int = Field(1, ge=1, description="Engine replicas behind the router.")
    kv_cache_memory_bytes: int | None = Field(
        _E.kv_cache_memory_bytes,
        gt=0,
        description="KV cache budget per replica (default: 1 GiB on CPU; on CUDA the "
        "gpu_memory_utilization share of the GPU's memory left after the weights and a profiled step).",
    )
    gpu_memory_utilization: float = Field(
        _E.gpu_memory_utilization, gt=0, le=1, description="CUDA: share of GPU memory a replica may use."
    )
    kv_offload_bytes: int = Field(
        _E.kv_offload_bytes,
        ge=0,
        description="Offload tier per replica (all ranks together): KV blocks evicted from the pool are kept "
        "here by hash and loaded back on a prefix hit instead of being recomputed; 0: off.",
    )
    kv_offload_medium: Literal[choices.KV_OFFLOAD_MEDIA] = Field(
        _E.kv_offload_medium,
        description="The offload tier's medium: disk (one memory-mapped file per rank) or host (host memory, "
        "pinned on CUDA).",
    )
    kv_offload_dir: str | None = Field(
        _E.kv_offload_dir,
        description="Where the disk tier's files live (default: a temporary directory per engine, removed at "
        "shutdown).",
    )
    max_model_len: int | None = Field(_E.max_model_len, description="Context length (default: the model's).")
    max_num_seqs: int = Field(_E.max_num_seqs, ge=1, description="Sequences per engine step.")
    max_num_batched_tokens: int = Field(_E.max_num_batched_tokens, ge=1, description="Tokens per engine step.")
    scheduling_policy: Literal[choices.SCHEDULING_POLICIES] = Field(
        _E.scheduling_policy,
        description="fcfs: arrival order; priority: a request's `priority` (lower first) orders the queue and "
        "picks whom to preempt.",
    )
    block_size: int = Field(_E.block_size, ge=1)
    enable_prefix_caching: bool = _E.enable_prefix_caching
    speculative: str | dict | None = Field(
        _E.speculative_config,
        description="Speculative decoding: 'ngram:k', 'self:k', 'draft:k:/local/model' or {method (ngram, draft, "
        "self), num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, model, draft_layers, "
        "draft_quantization, draft_num_blocks} (None = off).",
    )
    enable_lora: bool = Field(
        _E.enable_lora,
        description="Serve PEFT LoRA adapters of the base model (engine/lora/): clients name one as `model` "
        "(OpenAI) or `adapter_id` (TGI); /v1/load_lora_adapter and /v1/unload_lora_adapter change them.",
    )
    max_loras: int = Field(_E.max_loras, ge=1, description="LoRA adapters in one engine batch (slots).")
    max_lora_rank: int = Field(
        _E.max_lora_rank, ge=1, description="The largest LoRA rank the slots hold; larger adapters are refused."
    )
    max_cpu_loras: int | None = Field(
        _E.max_cpu_loras, ge=1, description="LoRA adapters kept in host memory per replica, LRU (default: max_loras)."
    )
    lora_modules: dict[str, str] | None = Field(
        None, description="LoRA adapters served from the start: name -> local adapter directory."
    )
    num_threads: int | None = Field(None, ge=1, description="torch threads per worker (default: its CPUs).")
    spare_core_max_tokens: int = Field(
        0,
        ge=0,
        description="CPU: engine steps of at most this many tokens run on one thread fewer, leaving a core to the "
        "processes that stream tokens out; 0 = never (the default: with served engines spinning ~2 ms and no "
        "proxy hop, every core for every step was 1.04-1.14x the tokens/s at 1-8 streams on 2 cores).",
    )
    warmup: bool = Field(
        _E.warmup,
        description="Before a replica reports ready, build every linear kernel its steps can need (each row-count "
        "bucket), so its first requests do not pay for them.",
    )
    cpus_per_worker: float = Field(1.0, ge=0, description="Ray CPUs reserved per TP worker (bundle).")
    gpus_per_worker: float | None = Field(None, ge=0, description="Ray GPUs per worker (default: 1 on cuda, else 0).")
    replica_resources: dict[str, float] | None = Field(
        None,
        description="Custom Ray resources each engine replica's first bundle asks for (pins the pool to the nodes "
        "that advertise them, e.g. a `ray up` node type's resources).",
    )
    engine_runtime_env: dict | None = Field(
        None,
        description="Ray runtime_env of the engine replicas (their tensor-parallel workers inherit it): "
        "env_vars, working_dir, ... The router needs only the tokenizer and config: when `model` does "
        "not exist where it runs, it gets them from an engine replica.",
    )

    # --- the router ---
    router_replicas: int = Field(1, ge=1, description="Router (ingress) replicas.")
    router_cpus: float = Field(0.0, ge=0, description="Ray CPUs reserved per router replica.")
    router_resources: dict[str, float] | None = Field(
        None,
        description="Custom Ray resources each router replica asks for (pins the routers to the nodes that "
        'advertise them; `{"node:__internal_head__": 0.001}`: the head, where a cluster keeps the key file).',
    )
    routing: Literal["cache-aware", "least-loaded", "round-robin"] = Field(
        "cache-aware",
        description="Replica choice: cache-aware (the replica holding most of the prompt's KV blocks, "
        "within a load guard; least-loaded when prefix caching is off), least-loaded or round-robin.",
    )
    kv_peer_fetch: Literal[PEER_FETCH_MODES] = Field(
        "auto",
        description="Cache-aware routing: when the load guard sends a request away from the replica holding "
        "its prefix, the chosen replica fetches the prefix's KV from that one instead of recomputing it: when "
        "its measured transfer and prefill speeds say the fetch is cheaper (auto), whenever it holds at least "
        "2 blocks more (always), or never (off).",
    )
    max_queued_requests: int = Field(
        256, ge=1, description="Queued (no token yet) requests per router replica; past it: 429."
    )
    max_queued_requests_per_replica: int = Field(
        64, ge=1, description="Queued requests per engine replica; past it: 429."
    )
    max_request_body_bytes: int = Field(4 << 20, ge=1024, description="Request body limit; past it: 413.")
    request_timeout_s: float = Field(600.0, gt=0, description="Per-request deadline; past it: 504 (or an error event).")
    body_timeout_s: float = Field(
        30.0, gt=0, description="Time a client has to send its request body; past it: 408 (a trickling client)."
    )
    write_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Time one write to a client may wait for it to read; past it the stream is cut and "
        "its request aborted (a client that stopped reading).",
    )
    max_waiting_connections: int = Field(
        1000,
        ge=1,
        description="HTTP requests a router replica holds waiting for a slot past its ongoing limit (Serve's "
        "max_queued_requests); past it they are refused at once.",
    )
    watermark_key_file: str | None = Field(
        None,
        description="File holding the watermark key (an integer in [0, 2^32), one line; read by the router, so it "
        "stays out of Ray's metadata). Requests with watermark true get green-list watermarked outputs and "
        "/v1/watermark/detect scores texts; without it both are refused.",
    )
    watermark_gamma: float = Field(0.5, gt=0, lt=1, description="Green share of the vocabulary (TGI's default).")
    watermark_delta: float = Field(2.0, ge=0, description="Logit bonus of green tokens (TGI's default).")
    report_cached_tokens: bool = Field(
        True,
        description="Responses report usage.prompt_tokens_details.cached_tokens. Off for mutually untrusted "
        "tenants that do not each send a cache_salt (a hit reveals that someone sent the same prefix).",
    )
    router_lease_s: float = Field(
        30.0,
        gt=0,
        description="An engine replica aborts the requests of a router it has not heard from for this long "
        "(the router died), freeing their KV blocks; routers renew their lease every third of it.",
    )
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        None,
        description="The model's tool-call syntax, for tool_choice 'auto' (hermes: <tool_call> JSON "
        "blocks: Hermes 2 Pro, Qwen2.5, Qwen3; llama3_json: Llama 3.1-3.3's JSON calls); None: 'auto' is a 400.",
    )
    reasoning_parser: Literal[REASONING_PARSERS] | None = Field(
        None,
        description="The model's reasoning syntax: chat completions move the text of its <think>...</think> "
        "block from `content` to `reasoning_content` (deepseek_r1: DeepSeek-R1, QwQ, the block opened by the "
        "prompt or the output; qwen3: Qwen3, none with chat_template_kwargs enable_thinking false). Structured "
        "outputs and held tool calls then hold the answer after </think> only. None: outputs as generated.",
    )
    pooling_type: Literal[choices.POOLING_TYPES] = Field(
        _E.pooling_type,
        description="/v1/embeddings: the vector is the model's final-norm hidden state of the last input token "
        "(last) or the mean over every input token (mean; takes no prefix-cache hits), L2-normalised.",
    )
    nonstream_batch_interval_s: float = Field(
        0.5,
        ge=0,
        description="Non-streamed requests: a replica sends "
        "outputs at most this often (fewer messages; a stop string is "
        "seen up to this late). 0 = every engine step.",
    )
    control_timeout_s: float = Field(10.0, gt=0, description="Deadline of stats / health / finish calls to replicas.")
    stuck_step_timeout_s: float = Field(
        120.0,
        gt=0,
        description="An engine step that has not returned after this long makes its replica "
        "unhealthy (/health 503; Serve replaces it and its requests move).",
    )
    max_migrations: int = Field(
        3,
        ge=0,
        description="Times one request may move to another engine replica when its replica dies "
        "or is drained mid-request (the stream goes on unchanged); past it: an error (503 / error "
        "event). 0 = never move.",
    )
    drain_timeout_s: float = Field(
        30.0,
        gt=0,
        description="An engine replica being removed (scale-down, redeploy) takes no new requests "
        "and finishes its running ones for at most this long; the rest move to other replicas.",
    )
    api_key: str | None = Field(
        None,
        description="Bearer key for /v1 and TGI routes (default: api_key_file, then api_key_env). Given here, "
        "the key travels in the router deployment's arguments (Ray's metadata); the file or the environment "
        "variable keeps it out: those are read by the router replica itself.",
    )
    api_key_file: str | None = Field(
        None, description="File holding the bearer key (~ expanded; one line), read where the router runs."
    )
    api_key_env: str | None = Field(
        None,
        description="Environment variable holding the bearer key, read where the router runs (default: "
        "ORBITAL_API_KEY when it is set where the config is built and no api_key / api_key_file is).",
    )
    allow_unauthenticated: bool = Field(
        False, description="Serve without a key on a non-loopback HTTP bind (otherwise the ingress refuses to start)."
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description="OpenTelemetry traces of each request's path (router/tracing.py): the OTLP/HTTP traces URL "
        "(e.g. http://collector:4318/v1/traces) the router and engine replicas send spans to. None: the standard "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT variables where they run decide; "
        "without either, tracing is off. The other OTEL_* variables (headers, sampler, batching) apply as usual.",
    )

    # --- disaggregated serving: a prefill pool beside the engine (decode) pool ---
    prefill_replicas: int = Field(
        0,
        ge=0,
        description="Replicas of the prefill pool. 0 = colocated (every engine replica prefills and decodes); "
        "> 0: the engine replicas (num_replicas, tensor_parallel_size) are the decode pool and ask the prefill "
        "pool for the KV of long uncached prompts.",
    )
    prefill_tensor_parallel_size: int | None = Field(
        None, ge=1, description="Workers per prefill replica (default: tensor_parallel_size); may differ from decode's."
    )
    prefill_pipeline_parallel_size: int | None = Field(
        None,
        ge=1,
        description="Pipeline stages per prefill replica (default: pipeline_parallel_size, with its "
        "pipeline_partition; another count splits the layers evenly).",
    )
    local_prefill_max_tokens: int = Field(
        64,
        ge=0,
        description="Disaggregated: an uncached prompt suffix of at most this many tokens is prefilled by the "
        "decode replica itself (no transfer).",
    )
    kv_transfer_failure: Literal["recompute", "fail"] = Field(
        "recompute",
        description="Disaggregated: when a remote prefill or its KV transfer fails, recompute on the decode "
        "replica, or fail the request with an error.",
    )
    prefill_replica_resources: dict[str, float] | None = Field(
        None,
        description="Disaggregated: custom Ray resources each prefill replica asks for (e.g. {prefill_node: 1}), "
        "to put the prefill pool on the nodes that advertise them; `replica_resources` does the same for decode.",
    )
    kv_transfer_timeout_s: float = Field(
        60.0, gt=0, description="Disaggregated: a remote prefill + transfer taking longer than this has failed."
    )

    # --- several models behind one endpoint ---
    models: list[ModelPool] | None = Field(
        None,
        min_length=1,
        description="Model pools, each its own engine deployment; clients pick one with `model` (none given: "
        "the first). None = one pool from the top-level fields.",
    )
    aliases: dict[str, list[str]] = Field(
        {},
        description="Alias -> ordered pools (a tier), smallest first: a request for the alias starts at the "
        "first pool (or where `tier_routing` says) and moves to the next when one sheds load (429) or fails "
        "before its first token.",
    )
    tier_routing: dict[str, TierRouting] = Field(
        {}, description="Alias -> how its requests pick their starting pool (rules, classifier, hint header)."
    )

    # --- scaling (router/controller/autoscaling_config.py) ---
    autoscaling: str | dict | None = Field(
        None,
        description="Autoscaling policy: path of a YAML file like "
        "deploy/autoscaling.yaml, or the same mapping inline; replaces "
        "num_replicas. None = a fixed num_replicas.",
    )

    @field_validator("speculative")
    @classmethod
    def _speculative(cls, v: str | dict | None) -> str | dict | None:
        from engine.spec_decode.config import SpeculativeConfig

        try:
            SpeculativeConfig.from_value(v)
        except (TypeError, ValueError) as e:
            raise ValueError(f"speculative: {e}") from None
        return v

    @field_validator("pipeline_partition", mode="before")
    @classmethod
    def _pipeline_partition(cls, v: object) -> object:
        return parse_partition(v) if isinstance(v, str) else v  # "14,16"; a list is checked as the field's type

    @model_validator(mode="after")
    def _pipeline(self) -> "AppConfig":
        ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size, self.pipeline_partition)
        return self

    @property
    def world_size(self) -> int:
        """Ranks per engine replica: a tensor-parallel group per pipeline stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @model_validator(mode="after")
    def _defaults(self) -> "AppConfig":
        # The variable's name, never its value: the config is the router deployment's arguments,
        # so a value copied here would sit in Ray's metadata.
        if self.api_key is None and not self.api_key_file and not self.api_key_env and os.environ.get(ENV_KEY):
            self.api_key_env = ENV_KEY
        return self

    @model_validator(mode="after")
    def _lora(self) -> "AppConfig":
        from engine.lora.config import LoRAConfig

        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules: needs enable_lora")
        if self.enable_lora:
            try:
                LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
            except ValueError as e:
                raise ValueError(str(e)) from None
        return self

    @model_validator(mode="after")
    def _disaggregated(self) -> "AppConfig":
        if self.prefill_replicas and self.models is not None:
            raise ValueError("prefill_replicas: disaggregated serving takes one model (no `models` pools)")
        return self

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0

    def prefill_pool_config(self) -> "AppConfig":
        """The prefill pool as a complete AppConfig (its replicas, TP and PP degrees, no autoscaling
        of its own unless the policy file names a `prefill` pool)."""
        pp = self.prefill_pipeline_parallel_size or self.pipeline_parallel_size
        return self.model_copy(
            update={
                "num_replicas": self.prefill_replicas,
                "tensor_parallel_size": self.prefill_tensor_parallel_size or self.tensor_parallel_size,
                "pipeline_parallel_size": pp,
                "pipeline_partition": self.pipeline_partition if pp == self.pipeline_parallel_size else None,
                "replica_resources": self.prefill_replica_resources,
                "speculative": None,
            }
        )

    def kv_transfer_config(self, role: str) -> dict | None:
        if not self.disaggregated:
            return None
        return {"role": role, "local_prefill_max_tokens": self.local_prefill_max_tokens}

    @model_validator(mode="after")
    def _pools(self) -> "AppConfig":
        if self.models is not None and self.served_model_name:
            raise ValueError("served_model_name: with `models`, each pool's `name` is its served name")
        names = [p.model_name for p in self.pool_configs()]  # also validates every merged pool
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"models: duplicate pool name(s) {dup}")
        for alias, tier in self.aliases.items():
            if alias in names:
                raise ValueError(f"aliases: {alias!r} is also a pool name")
            if not tier:
                raise ValueError(f"aliases.{alias}: names no pool")
            unknown = [p for p in tier if p not in names]
            if unknown:
                raise ValueError(f"aliases.{alias}: unknown pool(s) {unknown}; pools: {names}")
            if len(set(tier)) != len(tier):
                raise ValueError(f"aliases.{alias}: a pool appears twice in {tier}")
        for alias, routing in self.tier_routing.items():
            if alias not in self.aliases:
                raise ValueError(f"tier_routing.{alias}: not an alias; aliases: {sorted(self.aliases)}")
            for i, rule in enumerate(routing.rules):
                if rule.pool not in self.aliases[alias]:
                    raise ValueError(f"tier_routing.{alias}.rules[{i}]: {rule.pool!r} is not in {self.aliases[alias]}")
        return self

    def pool_configs(self) -> list["AppConfig"]:
        """One complete AppConfig per model pool (the pool's fields over the top-level ones; no
        `models`, no `aliases`). `models=None`: [self], one pool as the top-level fields say."""
        if self.models is None:
            return [self]
        base = self.model_dump(exclude={"models", "aliases", "tier_routing"})
        out = []
        for i, pool in enumerate(self.models):
            try:
                out.append(AppConfig(**{**base, **pool.overrides()}))
            except ValidationError as e:
                bad = "; ".join(f"{'.'.join(map(str, x['loc'])) or '?'}: {x['msg']}" for x in e.errors())
                raise ValueError(f"models[{i}] ({pool.name!r}): {bad}") from None
        return out

    def resolve_api_key(self) -> str | None:
        """The key requests must carry: `api_key`, else `api_key_file`'s contents, else the
        variable `api_key_env`, read where the ingress runs (the file is on the serving nodes, not
        necessarily where this was built). A named file or variable that holds nothing raises:
        it never means "no key"."""
        if self.api_key or not (self.api_key_file or self.api_key_env):
            return self.api_key
        if not self.api_key_file:
            key = os.environ.get(self.api_key_env, "").strip()
            if not key:
                raise PermissionError(f"api_key_env: ${self.api_key_env} is not set where the router runs")
            return key
        path = os.path.expanduser(self.api_key_file)
        try:
            with open(path) as f:
                key = f.read().strip()
        except OSError as e:
            raise PermissionError(f"api_key_file: cannot read {path}: {e.strerror}") from None
        if not key:
            raise PermissionError(f"api_key_file: {path} is empty")
        return key

    @property
    def model_name(self) -> str:
        from engine.model.gguf_convert import EMBEDDED_NAME

        if self.served_model_name:
            return self.served_model_name
        if not self.model or self.model == "default":
            return EMBEDDED_NAME
        return os.path.basename(os.path.normpath(self.model)) or self.model

    @property
    def worker_gpus(self) -> float:
        if self.gpus_per_worker is not None:
            return self.gpus_per_worker
        return 1.0 if self.device.startswith("cuda") else 0.0

    def watermark(self) -> Watermark | None:
        """The deployment's watermark, its key read from `watermark_key_file` (None: not set)."""
        if not self.watermark_key_file:
            return None
        path = os.path.expanduser(self.watermark_key_file)
        try:
            key = int(open(path).read().strip())
        except (OSError, ValueError) as e:
            raise PermissionError(f"watermark_key_file: cannot read an integer key from {path}: {e}") from None
        return Watermark(key, self.watermark_gamma, self.watermark_delta)

    def engine_args(self, kv_role: str = "decode") -> dict:
        """EngineArgs fields (a plain dict, so it travels to replicas as-is). `kv_role`: which
        pool of a disaggregated app the engine serves (ignored when colocated)."""
        return {
            "kv_transfer_config": self.kv_transfer_config(kv_role),
            "model": self.model,
            "dtype": self.dtype,
            "quantization": self.quantization,
            "int8_activations": self.int8_activations,
            "kv_cache_dtype": self.kv_cache_dtype,
            "device": self.device,
            "block_size": self.block_size,
            "enable_prefix_caching": self.enable_prefix_caching,
            "speculative_config": self.speculative,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "scheduling_policy": self.scheduling_policy,
            "max_model_len": self.max_model_len,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kv_offload_bytes": self.kv_offload_bytes,
            "kv_offload_medium": self.kv_offload_medium,
            "kv_offload_dir": self.kv_offload_dir,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "pipeline_partition": self.pipeline_partition,
            "served_model_name": self.model_name,
            "num_threads": self.num_threads or max(1, int(self.cpus_per_worker)),
            "spare_core_max_tokens": self.spare_core_max_tokens,
            "warmup": self.warmup,
            "pooling_type": self.pooling_type,
            "enable_lora": self.enable_lora,
            "max_loras": self.max_loras,
            "max_lora_rank": self.max_lora_rank,
            "max_cpu_loras": self.max_cpu_loras,
            "lora_modules": dict(self.lora_modules) if self.lora_modules else None,
        }
