"""Several models behind one endpoint, in the ingress: one `PoolClient` per model pool (its engine
deployment's handle, tokenizer, `EngineClient` with its own router queue, `OpenAIServing`,
`TGIServing`), and `ModelPools`, which picks the pool an OpenAI request names.

`model` in the body picks the pool by its served name; none (or "") picks the first pool; an
alias (`AppConfig.aliases`) names a tier, an ordered list of pools, smallest first. The tier's
policy (router/tiering/policy.py: the `x-orbital-tier` hint header, the operator's rules, a
learned classifier) picks the pool a request starts at; the request moves on to the next pool
when its pool sheds load (`OverloadedError`, 429) or fails it with a replica's failure
(`moves_request`: the pool's own failover could not move it) before the first output. Any other error is the answer; when every later pool fails too, the client gets
the last one's error. Responses carry the name the client asked for. TGI routes (no model field)
use the first pool.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Iterator

from ray.exceptions import RayTaskError

from engine.errors import InvalidRequestError
from router.backpressure import IngressQueue, OverloadedError
from router.ingress.embeddings_api import EmbeddingServing
from router.ingress.engine_client import EngineClient
from router.ingress.errors import APIError
from router.ingress.failover import moves_request
from router.ingress.lora_adapters import LoRAAdapters
from router.ingress.openai_api import OpenAIServing
from router.ingress.openai_models import ModelCard, ModelList
from router.ingress.streams import prepend
from router.ingress.tgi_api import TGIServing
from router.ingress.tokenize_api import detokenize, tokenize
from router.tiering.features import request_features
from router.tiering.policy import HINT_HEADER, REASONS, TierHintError, TierPolicy

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from router.config import AppConfig
    from router.messages import TextSideFiles

log = logging.getLogger(__name__)


@dataclass
class PoolClient:
    """One model pool as the ingress sees it."""

    name: str
    handle: DeploymentHandle
    client: EngineClient
    openai: OpenAIServing
    tgi: TGIServing
    embeddings: EmbeddingServing
    max_model_len: int
    expected_replicas: int  # what /health wants up (num_replicas; min_replicas when autoscaled)
    loras: LoRAAdapters | None = None  # its LoRA adapters by name (enable_lora); None: off


@dataclass
class SidePool:
    """A pool the ingress sends no requests to but watches (/health, /metrics): the prefill
    pool of a disaggregated app."""

    name: str
    handle: DeploymentHandle
    expected_replicas: int


async def with_local_text_side(cfg: AppConfig, handle: DeploymentHandle) -> AppConfig:
    """`cfg` itself when its model path exists on this node; else a copy naming a local directory
    with the tokenizer and config an engine replica sent (the served name stays)."""
    from engine.model.gguf_convert import cache_root
    from engine.model.loader import resolve_model_dir
    from engine.model.text_side import materialise_text_side

    try:
        resolve_model_dir(cfg.model)
        return cfg
    except FileNotFoundError as e:
        log.info("%s; asking an engine replica for the tokenizer and config", e)
    sent: TextSideFiles = await handle.text_side.remote()
    local = materialise_text_side(sent.files, cache_root())
    return cfg.model_copy(update={"model": str(local), "served_model_name": cfg.model_name})


def build_pool(cfg: AppConfig, handle: DeploymentHandle) -> PoolClient:
    """A pool's text side from its merged config (`AppConfig.pool_configs()`): the tokenizer and
    the model's limits from its directory, never its weights."""
    import torch
    from transformers import AutoTokenizer

    from engine.model_config import build_model_config
    from engine.text.input_processor import InputProcessor

    mc = build_model_config(cfg.model, cfg.dtype, torch.device("cpu"), cfg.max_model_len, cfg.model_name)
    tokenizer = AutoTokenizer.from_pretrained(mc.model_dir)
    inputs = InputProcessor(tokenizer, mc, cfg.enable_prefix_caching)
    watermark = cfg.watermark()  # read here, in the router replica
    loras = LoRAAdapters(cfg.model_name, mc.hf_config, cfg.max_lora_rank, cfg.lora_modules) if cfg.enable_lora else None
    client = EngineClient(
        handle,
        tokenizer,
        inputs,
        IngressQueue(cfg.max_queued_requests),
        cfg.control_timeout_s,
        cfg.nonstream_batch_interval_s,
        cfg.max_migrations,
        cfg.drain_timeout_s,
        cfg.router_lease_s,
    )
    info = {
        "model_id": cfg.model_name,
        "model_dtype": str(mc.dtype).removeprefix("torch."),
        "model_device_type": cfg.device,
        "max_concurrent_requests": cfg.max_queued_requests,
        "max_input_tokens": mc.max_model_len - 1,
        "max_total_tokens": mc.max_model_len,
        "version": "0.1.0",
        "model_pipeline_tag": "text-generation",
        "router": "orbital",
        "max_best_of": 1,
        "max_stop_sequences": 16,
        "validation_workers": 1,
        "max_client_batch_size": 1,
        "model_sha": None,
        "sha": None,
        "docker_label": None,
    }
    return PoolClient(
        name=cfg.model_name,
        handle=handle,
        client=client,
        openai=OpenAIServing(
            client,
            cfg.model_name,
            mc.max_model_len,
            cfg.tool_call_parser,
            cfg.report_cached_tokens,
            watermark,
            cfg.reasoning_parser,
            loras,
        ),
        tgi=TGIServing(client, cfg.model_name, info, watermark, loras),
        embeddings=EmbeddingServing(client, cfg.model_name, cfg.pooling_type, mc.hf_config.hidden_size),
        max_model_len=mc.max_model_len,
        expected_replicas=cfg.num_replicas,
        loras=loras,
    )


def is_overloaded(exc: BaseException) -> bool:
    """A pool shed the request (429): the router queue refused it, or the engine replica's
    `submit` did (then it arrives wrapped by Ray)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OverloadedError):
            return True
        seen.add(id(exc))
        if isinstance(exc, BaseExceptionGroup):
            return any(is_overloaded(e) for e in exc.exceptions)
        exc = exc.cause if isinstance(exc, RayTaskError) else None
    return False


async def _empty() -> AsyncIterator:
    return
    yield


async def _started(result: Any) -> Any:
    """A response dict as it is; a stream once its first chunk is there (errors before it, a 429
    among them, are raised here, where the next pool may still take the request)."""
    if not hasattr(result, "__anext__"):
        return result
    try:
        first = await result.__anext__()
    except StopAsyncIteration:
        return _empty()
    except BaseException:
        await result.aclose()
        raise
    return prepend(first, result)


def overflow_cause(exc: BaseException) -> str | None:
    """Why a request may move to the tier's next pool: "overload" (the pool shed it), "error"
    (its replica failed, not the request), or None (the error is the answer)."""
    if is_overloaded(exc):
        return "overload"
    return "error" if moves_request(exc) else None


OVERFLOW_CAUSES = ("overload", "error")


class ModelPools:
    """Every pool of this ingress, in config order (the first is the default), and the aliases
    with their tier policies."""

    def __init__(
        self,
        pools: list[PoolClient],
        aliases: dict[str, list[str]] | None = None,
        policies: dict[str, TierPolicy] | None = None,
    ) -> None:
        if not pools:
            raise ValueError("at least one model pool is needed")
        self.by_name = {p.name: p for p in pools}
        self.default = pools[0]
        self.aliases = {a: list(tier) for a, tier in (aliases or {}).items()}
        self.policies = {a: (policies or {}).get(a) or TierPolicy(a, tier) for a, tier in self.aliases.items()}
        # Every series is listed from the start, so /metrics shows the zeros.
        # (alias, from pool, to pool, cause) -> requests that moved on;
        self.overflows: dict[tuple[str, str, str, str], int] = {
            (a, src, dst, cause): 0
            for a, tier in self.aliases.items()
            for src, dst in zip(tier, tier[1:])
            for cause in OVERFLOW_CAUSES
        }
        # (alias, pool, reason) -> requests that started at that pool.
        self.decisions: dict[tuple[str, str, str], int] = {
            (a, p, reason): 0 for a, tier in self.aliases.items() for p in tier for reason in REASONS
        }

    @classmethod
    async def build(cls, cfg: AppConfig, engines: dict[str, DeploymentHandle]) -> ModelPools:
        """One PoolClient per pool of `cfg` (the whole app's config); `engines` maps each pool's
        served name to its engine deployment's handle. A pool whose model path is missing here
        gets its tokenizer and config from one of its engine replicas (waits for one to start)."""
        pools = []
        for p in cfg.pool_configs():
            handle = engines[p.model_name]
            pools.append(build_pool(await with_local_text_side(p, handle), handle))
        policies = {a: TierPolicy(a, cfg.aliases[a], routing) for a, routing in cfg.tier_routing.items()}
        return cls(pools, cfg.aliases, policies)

    def __iter__(self) -> Iterator[PoolClient]:
        return iter(self.by_name.values())

    def get(self, name: str | None = None) -> PoolClient:
        """A pool by its name (None: the default one)."""
        if name is None:
            return self.default
        try:
            return self.by_name[name]
        except KeyError:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found") from None

    def tier(self, model: str | None) -> list[PoolClient]:
        """The pools a request for `model` may use, in order (404 for an unknown name). A LoRA
        adapter's name is served by the pool of its base model."""
        if model in self.aliases:
            return [self.by_name[p] for p in self.aliases[model]]
        if model and model not in self.by_name:
            for p in self:
                if p.loras is not None and p.loras.get(model) is not None:
                    return [p]
        return [self.get(model or None)]

    def lora_pool(self, model: str | None) -> PoolClient:
        """The pool whose adapters /v1/load_lora_adapter and /v1/unload_lora_adapter change
        (None: the first)."""
        pool = self.get(model or None)
        if pool.loras is None:
            raise InvalidRequestError(f"{pool.name!r} serves no LoRA adapters (start it with enable_lora)")
        return pool

    def models(self) -> dict:
        """/v1/models: every pool, then every alias (with its first pool's context length), then
        every LoRA adapter with its base model as `parent` (vLLM's cards)."""
        cards = [ModelCard(id=p.name, root=p.name, max_model_len=p.max_model_len) for p in self]
        for alias, tier in self.aliases.items():
            first = self.by_name[tier[0]]
            cards.append(ModelCard(id=alias, root=first.name, max_model_len=first.max_model_len))
        for p in self:
            for name, lora in (p.loras.adapters if p.loras is not None else {}).items():
                cards.append(ModelCard(id=name, root=lora.lora_path, parent=p.name, max_model_len=p.max_model_len))
        return ModelList(data=cards).model_dump()

    async def detect_watermark(self, body: dict) -> dict:
        """/v1/watermark/detect, with the tokenizer of the pool `model` names (default: the first)."""
        return await self._pool_of(body).openai.detect_watermark({k: v for k, v in body.items() if k != "model"})

    def _pool_of(self, body: dict) -> PoolClient:
        """The pool whose tokenizer serves a body's `model` (an alias: its tier's first pool)."""
        model = body.get("model") if isinstance(body.get("model"), str) and body.get("model") else None
        return self.tier(model)[0]

    async def tokenize(self, body: dict) -> dict:
        pool = self._pool_of(body)
        return await tokenize(pool.client, pool.max_model_len, body)

    async def detokenize(self, body: dict) -> dict:
        return await detokenize(self._pool_of(body).client, body)

    async def embeddings(self, body: dict) -> dict:
        """/v1/embeddings on the pool `model` names (an alias: its tier's first pool, and only that
        one: vectors of different models are not comparable, so a request never moves on)."""
        model = body.get("model") if isinstance(body.get("model"), str) and body.get("model") else None
        pool = self._pool_of(body)
        return await pool.embeddings.create(body, model or pool.name)

    async def completions(self, body: dict, tier_hint: str | None = None) -> dict | AsyncIterator[dict]:
        return await self._openai(body, lambda pool, name: pool.openai.completions(body, name), tier_hint)

    async def chat_completions(self, body: dict, tier_hint: str | None = None) -> dict | AsyncIterator[dict]:
        return await self._openai(body, lambda pool, name: pool.openai.chat_completions(body, name), tier_hint)

    async def _start(self, alias: str, tier: list[PoolClient], body: dict, hint: str | None) -> int:
        """Where a request for `alias` starts in its tier (counted in `decisions`)."""
        policy = self.policies[alias]
        features = None
        if policy.needs_features and not hint:
            tokenizer = tier[0].client.tokenizer  # prompt length as the tier's first pool counts it
            features = await asyncio.to_thread(request_features, body, lambda s: len(tokenizer(s).input_ids))
        try:
            decision = policy.decide(features, hint)
        except TierHintError as e:
            raise APIError(400, str(e), param=HINT_HEADER) from None
        self.decisions[(alias, tier[decision.start].name, decision.reason)] += 1
        return decision.start

    async def _openai(
        self, body: dict, call: Callable[[PoolClient, str], Awaitable], hint: str | None = None
    ) -> dict | AsyncIterator[dict]:
        requested = body.get("model")
        # A `model` that is not a string is left to the pool's validation (400 naming the field).
        model = requested if isinstance(requested, str) and requested else None
        tier = self.tier(model)
        served_as = model or tier[0].name
        if model in self.aliases:
            start = await self._start(model, tier, body, hint)
        elif hint:
            raise APIError(
                400, f"{HINT_HEADER}: only a tier alias takes a hint; {served_as!r} is a pool", param=HINT_HEADER
            )
        else:
            start = 0
        for i in range(start, len(tier)):
            pool, last = tier[i], i + 1 == len(tier)
            try:
                result = await call(pool, served_as)
                # A stream's errors come with its first chunk: wait for it while another pool
                # may still take the request.
                return result if last else await _started(result)
            except Exception as e:  # noqa: BLE001 - only load shedding and replica failures move on
                cause = None if last else overflow_cause(e)
                if cause is None:
                    raise
                nxt = tier[i + 1].name
                self.overflows[(served_as, pool.name, nxt, cause)] += 1
                log.info("%s: pool %s failed (%s), trying %s", served_as, pool.name, cause, nxt)
        raise AssertionError("unreachable")  # the last pool returns or raises
