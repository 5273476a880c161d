"""The OpenAPI schema (`/openapi.json`, `/docs`) with every route's request body and error shapes.

The routes read the raw request themselves (body-size limit, Content-Type, the API's own error
shapes instead of FastAPI's 422), so FastAPI cannot see their bodies: this adds them from the
same pydantic models the handlers validate with, plus each API's error body per status.
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from router.ingress.embeddings_api import EmbeddingRequest
from router.ingress.errors import is_tgi_path
from router.ingress.lora_adapters import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from router.ingress.openai_models import ChatCompletionRequest, CompletionRequest, WatermarkDetectRequest
from router.ingress.response_models import SSE, SUCCESS, Health
from router.ingress.responses_models import ResponsesRequest
from router.ingress.tgi_models import GenerateRequest
from router.ingress.tokenize_api import DetokenizeRequest, TokenizeRequest
from router.tiering.policy import HINT_HEADER

REF = "#/components/schemas/{model}"
BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/completions", "post"): CompletionRequest,
    ("/v1/chat/completions", "post"): ChatCompletionRequest,
    ("/v1/responses", "post"): ResponsesRequest,
    ("/v1/watermark/detect", "post"): WatermarkDetectRequest,
    ("/v1/embeddings", "post"): EmbeddingRequest,
    ("/tokenize", "post"): TokenizeRequest,
    ("/detokenize", "post"): DetokenizeRequest,
    ("/generate", "post"): GenerateRequest,
    ("/generate_stream", "post"): GenerateRequest,
    ("/", "post"): GenerateRequest,
    ("/v1/load_lora_adapter", "post"): LoadLoRAAdapterRequest,
    ("/v1/unload_lora_adapter", "post"): UnloadLoRAAdapterRequest,
}
# Routes that answer a line of plain text, as vLLM's do.
PLAIN_TEXT = {("/v1/load_lora_adapter", "post"), ("/v1/unload_lora_adapter", "post")}
OPENAI_ERRORS = {
    "400": "Invalid request (bad JSON, field or value; prompt over the context length).",
    "401": "Missing or wrong API key.",
    "404": "Unknown model (or stored response).",
    "413": "Body over the size limit.",
    "415": "Content-Type is not JSON.",
    "429": "Overloaded: retry after the Retry-After header's seconds.",
    "503": "No engine replica can serve it.",
    "504": "The request's deadline passed.",
}
# The routes whose requests may name a tier alias, which takes the hint header.
TIER_HINTED = {("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/responses", "post")}
# Routes without a body that still answer in the OpenAI error shape.
BODILESS = {("/v1/responses/{response_id}", "get"), ("/v1/responses/{response_id}", "delete")}
# Bodiless routes behind the API key that answer its errors in the OpenAI shape.
KEYED = {("/cluster/state", "get")}
KEY_ERRORS = {
    "401": OPENAI_ERRORS["401"],
    "403": "No API key is set and the Host header does not name this machine.",
}
# Event streams that end without `data: [DONE]`.
NO_DONE = {"/v1/responses"}
TIER_HINT = {
    "name": HINT_HEADER,
    "in": "header",
    "required": False,
    "schema": {"type": "string"},
    "description": "For a tier alias: the pool of its tier the request starts at (a 400 for any other model).",
}
# TGI answers validation errors with 422 (router/ingress/errors.py), the rest as OpenAI does.
TGI_ERRORS = {"422" if code == "400" else code: text for code, text in OPENAI_ERRORS.items()}
SCHEMAS: dict[str, dict[str, Any]] = {
    "OpenAIError": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    },
    "TGIError": {
        "type": "object",
        "required": ["error", "error_type"],
        "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}},
    },
}


def _error_responses(errors: dict[str, str], schema: str) -> dict[str, Any]:
    content = {"application/json": {"schema": {"$ref": REF.format(model=schema)}}}
    return {code: {"description": text, "content": content} for code, text in errors.items()}


def _add_schema(schemas: dict[str, Any], model: type[BaseModel]) -> dict[str, str]:
    """Put `model` (and the models it uses) into the components; returns its $ref."""
    model_schema = model.model_json_schema(ref_template=REF)
    schemas.update(model_schema.pop("$defs", {}))
    schemas[model.__name__] = model_schema
    return {"$ref": REF.format(model=model.__name__)}


def _sse_event(ref: dict[str, str], done: bool) -> dict[str, Any]:
    """One server-sent event: its `data` is the JSON text of `ref`, or on the OpenAI routes
    (`done`) the literal `[DONE]` that ends the stream. The JSON Schema 2020-12 content keywords
    say so; clients (and schemathesis) parse it."""
    data: dict[str, Any] = {"type": "string", "contentMediaType": "application/json", "contentSchema": ref}
    if done:
        data = {"anyOf": [data, {"const": "[DONE]"}]}
    return {"type": "object", "required": ["data"], "properties": {"data": data, "event": {"type": "string"}}}


def _success(schemas: dict[str, Any], bodies: dict[str, type[BaseModel]], path: str) -> dict[str, Any]:
    done = path.startswith("/v1/") and path not in NO_DONE
    content = {
        ctype: {"schema": _sse_event(_add_schema(schemas, m), done) if ctype == SSE else _add_schema(schemas, m)}
        for ctype, m in bodies.items()
    }
    text = "The answer." if len(bodies) == 1 else "The answer; with `stream`, server-sent events, one per `data:` line."
    return {"description": text, "content": content}


def openapi_with_bodies(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """A replacement for `app.openapi` (FastAPI caches the result on the app)."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(SCHEMAS)
        for (path, method), bodies in SUCCESS.items():
            op = spec["paths"].get(path, {}).get(method)
            if op is not None:
                op["responses"]["200"] = _success(schemas, bodies, path)
        for path, method in PLAIN_TEXT:
            op = spec["paths"].get(path, {}).get(method)
            if op is not None:
                text = {"text/plain": {"schema": {"type": "string"}}}
                op["responses"]["200"] = {"description": "What was done, in a line of text.", "content": text}
        health = spec["paths"].get("/health", {}).get("get")
        if health is not None:
            health["responses"]["503"] = {
                "description": "A pool lacks replicas, or one did not answer its health check.",
                "content": {"application/json": {"schema": _add_schema(schemas, Health)}},
            }
        for (path, method), model in BODIES.items():
            op = spec["paths"].get(path, {}).get(method)
            if op is None:
                continue
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": _add_schema(schemas, model)}},
            }
            if (path, method) in TIER_HINTED:
                op["parameters"] = [*op.get("parameters", []), TIER_HINT]
            tgi = is_tgi_path(path)
            op["responses"].pop("422", None)  # FastAPI's own validation error: never sent
            op["responses"].update(
                _error_responses(TGI_ERRORS, "TGIError") if tgi else _error_responses(OPENAI_ERRORS, "OpenAIError")
            )
        for path, method in BODILESS:
            op = spec["paths"].get(path, {}).get(method)
            if op is not None:
                op["responses"].pop("422", None)
                op["responses"].update(_error_responses(OPENAI_ERRORS, "OpenAIError"))
        for path, method in KEYED:
            op = spec["paths"].get(path, {}).get(method)
            if op is not None:
                op["responses"].update(_error_responses(KEY_ERRORS, "OpenAIError"))
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        app.openapi_schema = spec
        return spec

    return build
