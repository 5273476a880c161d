"""The ingress: a FastAPI Serve deployment. Tokenizes, applies the chat template, picks an engine
replica (through the engine handle's RequestRouter), detokenizes incrementally and streams.

HTTP routes: OpenAI (/v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings,
/v1/models), TGI (POST /, /generate, /generate_stream, /info), operations (/health, /metrics,
/cluster/state), and the web page (GET /: a chat box and the cluster's state).
Several model pools (`AppConfig.models`): OpenAI requests go to the pool (or alias tier) their
`model` names, TGI routes to the first pool (`router/ingress/model_pools.py`); /health and
/metrics cover every pool.
The class holds the HTTP routes and what they share (auth, body, SSE responses through
`router/ingress/sse.py`). Its bases hold the Python handle methods (same bodies as HTTP, dicts
in and out): `HandleAPI` (`router/ingress/handle_api.py`: requests, LoRA adapters, routing
figures) and `PoolReports` (`router/ingress/pool_reports.py`: health, replica stats, metrics,
cluster state).
"""

# No `from __future__ import annotations` here: FastAPI reads the route methods' annotations
# (`request: Request`) after Serve rewrites them into class-based views, and string annotations
# made `request` a required query parameter (every POST answered 400).
import asyncio
import hmac
import logging
from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

import router.tracing as tracing
from router.config import AppConfig
from router.ingress.errors import APIError, api_path, error_response, install_handlers, read_json
from router.ingress.handle_api import HandleAPI
from router.ingress.model_pools import ModelPools, SidePool
from router.ingress.openapi import openapi_with_bodies
from router.ingress.pool_reports import PoolReports
from router.ingress.public_bind import check_public_bind, is_loopback, serve_http_host
from router.ingress.responses_api import ResponsesAPI
from router.ingress.shared_result import SharedResult
from router.ingress.sse import WriteDeadlineResponse, sse_stream
from router.ingress.web_page import web_page
from router.tiering.policy import HINT_HEADER

log = logging.getLogger(__name__)
app = FastAPI(title="Orbital", description="OpenAI- and TGI-compatible LLM serving on Ray Serve.")
install_handlers(app)
app.openapi = openapi_with_bodies(app)


def _host_name(host: str) -> str:
    """The name in a Host header, without its port ("[::1]:8000" -> "::1")."""
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress(HandleAPI, PoolReports):
    async def __init__(
        self,
        engines: dict[str, DeploymentHandle] | DeploymentHandle,
        config: dict,
        prefill: DeploymentHandle | None = None,
    ) -> None:
        """`engines`: each model pool's served name -> its engine deployment's handle (one
        handle alone: the one pool of a config without `models`). `prefill`: a disaggregated
        app's prefill pool (requests go to the decode pool, `engines`; /health and /metrics
        cover both)."""
        self.settings = cfg = AppConfig(**config)
        tracing.setup("router", cfg.otlp_traces_endpoint)
        # Resolved here, in the replica: `config` (Ray's metadata) names the key file or variable.
        host = serve_http_host()
        self.api_key = check_public_bind(cfg, host)
        # Served on loopback without a key: only requests that name this machine in Host, so a
        # web page whose name resolves to 127.0.0.1 (DNS rebinding) cannot drive it.
        self.check_host = self.api_key is None and host is not None and is_loopback(host)
        if not isinstance(engines, dict):
            engines = {cfg.pool_configs()[0].model_name: engines}
        # Text lives here: each pool's tokenizer and model limits, never its weights.
        self.pools = await ModelPools.build(cfg, engines)
        default = self.pools.default
        self.engine, self.client, self.openai, self.tgi = default.handle, default.client, default.openai, default.tgi
        # Stored responses live in this replica's memory (router/ingress/responses_api.py).
        self.responses = ResponsesAPI(self.pools.chat_completions)
        self.prefill = SidePool("prefill", prefill, cfg.prefill_replicas) if prefill is not None else None
        # /health (anyone may call it) shares one fan-out a second; /metrics (behind the key)
        # shares the one in flight. The handle methods compute their own.
        self._shared_health = SharedResult(self.health)
        self._shared_metrics = SharedResult(self.metrics, ttl_s=0.0)
        self._shared_state = SharedResult(self.cluster_state, ttl_s=0.0)
        try:
            self.app_name = serve.get_replica_context().app_name
        except Exception:  # noqa: BLE001
            self.app_name = "default"

    # --- plumbing ---------------------------------------------------------------------------

    def _auth(self, request: Request) -> None:
        key = self.api_key
        if not key:
            if self.check_host and not is_loopback(_host_name(request.headers.get("host", ""))):
                raise APIError(403, "the Host header must name this machine (localhost or a loopback address)")
            return
        got = request.headers.get("authorization", "")
        # Bytes, not str: compare_digest refuses non-ASCII str (a header may carry any byte).
        given = got[7:].strip().encode("utf-8", "surrogateescape")
        if not (got.startswith("Bearer ") and hmac.compare_digest(given, key.encode("utf-8"))):
            raise APIError(401, "Incorrect or missing API key (Authorization: Bearer <key>).", code="invalid_api_key")

    async def _body(self, request: Request) -> dict:
        self._auth(request)
        try:  # a client trickling its body holds a slot: it gets body_timeout_s
            async with asyncio.timeout(self.settings.body_timeout_s):
                body = await read_json(request, self.settings.max_request_body_bytes)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.settings.body_timeout_s:g} s") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    async def _respond(self, request: Request, make, tgi: bool = False, events: bool = False) -> Response:
        """`make(body)` -> coroutine of a dict or of an async iterator of chunk dicts (`events`:
        Responses API events). Traced (router/tracing.py): one SERVER span per request, the child
        of the client's `traceparent`, current while the request is made."""
        span = None
        if tracing.enabled():
            route = api_path(request)  # without the app's route prefix
            attributes = {"http.request.method": request.method, "http.route": route, "url.path": request.url.path}
            span = tracing.start_server_span(f"{request.method} {route}", request.headers, attributes)
        with tracing.use(span):
            try:
                result = await self._call(make(await self._body(request)))
                if not hasattr(result, "__anext__"):
                    tracing.end(span, {"http.response.status_code": 200})
                    return JSONResponse(result)
                first = await result.__anext__()  # errors before the first chunk keep their HTTP status
            except Exception as e:  # noqa: BLE001 - every error in the API's shape
                response = error_response(e, api_path(request))
                status = response.status_code
                tracing.end(span, {"http.response.status_code": status}, error=e if status >= 500 else None)
                return response
        return WriteDeadlineResponse(
            sse_stream(first, result, tgi, events, span),
            self.settings.write_timeout_s,
            span=span,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    # --- OpenAI -----------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def http_completions(self, request: Request) -> Response:
        hint = request.headers.get(HINT_HEADER)
        return await self._respond(request, lambda body: self.pools.completions(body, hint))

    @app.post("/v1/watermark/detect")
    async def http_detect_watermark(self, request: Request) -> Response:
        """A text's watermark z-score and p-value under this deployment's key."""
        return await self._respond(request, self.pools.detect_watermark)

    @app.post("/v1/embeddings")
    async def http_embeddings(self, request: Request) -> Response:
        """OpenAI's: each input's pooled, normalised final hidden state (router/ingress/embeddings_api.py)."""
        return await self._respond(request, self.pools.embeddings)

    @app.post("/tokenize")
    async def http_tokenize(self, request: Request) -> Response:
        """vLLM's: a prompt or chat messages -> the token ids the engine would get, and their count."""
        return await self._respond(request, self.pools.tokenize)

    @app.post("/detokenize")
    async def http_detokenize(self, request: Request) -> Response:
        """vLLM's: token ids -> text."""
        return await self._respond(request, self.pools.detokenize)

    @app.post("/v1/chat/completions")
    async def http_chat_completions(self, request: Request) -> Response:
        hint = request.headers.get(HINT_HEADER)
        return await self._respond(request, lambda body: self.pools.chat_completions(body, hint))

    @app.post("/v1/responses")
    async def http_responses(self, request: Request) -> Response:
        """OpenAI's Responses API, on the chat completions path (router/ingress/responses_api.py)."""
        hint = request.headers.get(HINT_HEADER)
        return await self._respond(request, lambda body: self.responses.create(body, hint), events=True)

    @app.get("/v1/responses/{response_id}")
    async def http_get_response(self, request: Request, response_id: str) -> Response:
        """A stored response (this router replica's memory)."""
        return await self._stored(request, lambda: self.responses.retrieve(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def http_delete_response(self, request: Request, response_id: str) -> Response:
        return await self._stored(request, lambda: self.responses.delete(response_id))

    async def _stored(self, request: Request, answer) -> Response:
        try:
            self._auth(request)
            for name in request.query_params:  # OpenAI's include, stream, starting_after: not done here
                raise APIError(400, f"{name}: query parameters are not supported on this route", param=name)
            return JSONResponse(answer())
        except Exception as e:  # noqa: BLE001 - every error in the API's shape
            return error_response(e, api_path(request))

    @app.get("/v1/models", response_model=None)  # the annotation is not a response model
    async def http_models(self, request: Request) -> JSONResponse | dict:
        try:
            self._auth(request)
        except APIError as e:
            return error_response(e, api_path(request))
        return self.pools.models()

    # --- LoRA adapters (router/ingress/lora_adapters.py) -------------------------------------

    @app.post("/v1/load_lora_adapter")
    async def http_load_lora_adapter(self, request: Request) -> Response:
        """vLLM's: serve a PEFT LoRA adapter directory under a name (`lora_name`, `lora_path`)."""
        return await self._lora_change(request, self.load_lora_adapter)

    @app.post("/v1/unload_lora_adapter")
    async def http_unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's: stop serving an adapter (`lora_name`); 404 for an unknown one."""
        return await self._lora_change(request, self.unload_lora_adapter)

    async def _lora_change(self, request: Request, change: Callable[[dict], Awaitable[str]]) -> Response:
        """`change`: the handle method (router/ingress/handle_api.py) that does it."""
        try:
            return PlainTextResponse(await change(await self._body(request)))
        except Exception as e:  # noqa: BLE001 - every error in the API's shape
            return error_response(e, api_path(request))

    # --- TGI --------------------------------------------------------------------------------

    @app.post("/generate")
    async def http_generate(self, request: Request) -> Response:
        return await self._respond(request, self.tgi.generate, tgi=True)

    @app.post("/generate_stream")
    async def http_generate_stream(self, request: Request) -> Response:
        return await self._respond(request, self.tgi.generate_stream, tgi=True)

    @app.post("/")
    async def http_compat_generate(self, request: Request) -> Response:
        """TGI's compat route (what InferenceClient(base_url) posts to): `stream` picks the kind."""
        return await self._respond(request, self._compat, tgi=True)

    async def _compat(self, body: dict):
        if body.get("stream"):
            return await self.tgi.generate_stream(body)
        return [await self.tgi.generate(body)]

    @app.get("/info", response_model=None)  # the annotation is not a response model
    async def http_info(self) -> dict:
        return self.tgi.info()

    # --- operations -------------------------------------------------------------------------

    @app.get("/health")
    async def http_health(self) -> JSONResponse:
        h = await self._shared_health.get()
        return JSONResponse(h, status_code=200 if h["status"] == "ok" else 503)

    @app.get("/metrics")
    async def http_metrics(self, request: Request) -> Response:
        """Behind the API key when there is one (Prometheus sends it as a bearer token): the
        page fans out one stats call per engine replica."""
        try:
            self._auth(request)
        except APIError as e:
            return error_response(e, api_path(request))
        page = await self._shared_metrics.get()
        return Response(page, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/cluster/state", response_model=None)  # the annotation is not a response model
    async def http_cluster_state(self, request: Request) -> Response:
        """What the web page's state panel shows: pools, replicas, load, KV usage, hit rates.
        Behind the API key as /metrics is."""
        try:
            self._auth(request)
        except APIError as e:
            return error_response(e, api_path(request))
        return JSONResponse(await self._shared_state.get(), headers={"Cache-Control": "no-store"})

    @app.get("/", include_in_schema=False)
    async def http_page(self) -> Response:
        """The web page (router/ingress/web/index.html): a chat box and the cluster's state. Static:
        it carries no data, so it needs no key; its requests send the key the user types."""
        return web_page()
