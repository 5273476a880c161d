"""`/openapi.json` says what the server does: every route documents its success body, and the
request schema's bounds are the ones the server enforces (a value just past a documented bound
is refused by SamplingParams too, a value on it is accepted), so generated clients and fuzzers
send what the server takes. No Ray: the schema is built from the ingress's FastAPI app."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from router.ingress.deployment import app
from router.ingress.response_models import SUCCESS


@pytest.fixture(scope="module")
def spec() -> dict:
    return app.openapi()


def _resolve(spec: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def test_every_route_documents_its_success_body(spec):
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            if path == "/metrics":  # Prometheus text
                continue
            ok = op["responses"].get("200", {})
            assert ok.get("content"), (path, method)
            for ctype, media in ok["content"].items():
                if ctype == "text/plain":  # vLLM's LoRA routes answer a line of text
                    assert media["schema"] == {"type": "string"}, (path, method)
                    continue
                assert _resolve(spec, media["schema"]).get("properties") or _resolve(spec, media["schema"]).get(
                    "items"
                ), (path, method)
    assert set(SUCCESS) <= {(p, m) for p, ops in spec["paths"].items() for m in ops}
    assert "503" in spec["paths"]["/health"]["get"]["responses"]


def _bounds(spec: dict, model: str) -> dict[str, dict]:
    """field -> its numeric/array bounds, through `anyOf` (optional fields)."""
    out = {}
    for name, prop in _resolve(spec, {"$ref": f"#/components/schemas/{model}"})["properties"].items():
        for s in [prop, *prop.get("anyOf", [])]:
            keys = {k: v for k, v in s.items() if k in ("minimum", "maximum", "exclusiveMinimum", "maxItems")}
            if keys:
                out[name] = keys
    return out


# OpenAI field -> the SamplingParams argument it becomes.
OPENAI_TO_PARAMS = {
    "n": "n",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens",
    "max_tokens": "max_tokens",
    "logprobs": "logprobs",
    "stop": "stop",
}


def _params(field: str, value) -> SamplingParams:
    kw = {OPENAI_TO_PARAMS[field]: value}
    if field == "min_tokens":
        kw["max_tokens"] = max(value, 1) if isinstance(value, int) and value >= 0 else 16
    return SamplingParams(**kw)


def test_completion_bounds_are_the_servers(spec):
    bounds = _bounds(spec, "CompletionRequest")
    assert set(OPENAI_TO_PARAMS) <= set(bounds), set(OPENAI_TO_PARAMS) - set(bounds)
    for field, b in bounds.items():
        if field not in OPENAI_TO_PARAMS:
            continue
        integer = field in ("n", "top_k", "min_tokens", "max_tokens", "logprobs")
        step = 1 if integer else 1e-9
        if "maxItems" in b:
            _params(field, ["x"] * b["maxItems"])
            with pytest.raises(InvalidRequestError):
                _params(field, ["x"] * (b["maxItems"] + 1))
        if "minimum" in b:
            _params(field, b["minimum"])
            with pytest.raises(InvalidRequestError):
                _params(field, b["minimum"] - step)
        if "exclusiveMinimum" in b:
            _params(field, b["exclusiveMinimum"] + step)
            with pytest.raises(InvalidRequestError):
                _params(field, b["exclusiveMinimum"])
        if "maximum" in b:
            _params(field, b["maximum"])
            with pytest.raises(InvalidRequestError):
                _params(field, b["maximum"] + step)
