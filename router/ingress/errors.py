"""Every 4xx/5xx in the API's own error shape.

OpenAI routes (/v1/...): `{"error": {"message", "type", "param", "code"}}`, validation errors are
400 `invalid_request_error` (OpenAI's status, not FastAPI's 422).
TGI routes (/, /generate, /generate_stream): `{"error": "...", "error_type": "validation" |
"overloaded" | "generation" | ...}` with TGI's status codes (422 for validation).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from ray.exceptions import RayTaskError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import AdapterNotFoundError, EngineDeadError, InvalidRequestError
from router.backpressure import OverloadedError

log = logging.getLogger(__name__)

TGI_PATHS = ("/generate", "/generate_stream")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}
_TGI_TYPES = {
    400: "validation",
    401: "authentication",
    404: "validation",
    413: "validation",
    415: "validation",
    422: "validation",
    429: "overloaded",
    503: "overloaded",
    504: "incomplete_generation",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else str(self.status),
            }
        }

    def tgi_body(self) -> dict[str, Any]:
        return {"error": self.message, "error_type": _TGI_TYPES.get(self.status, "generation")}

    def tgi_status(self) -> int:
        return 422 if self.status == 400 else self.status


def _unwrap(exc: BaseException) -> BaseException:
    """The error that says what happened: a Ray task error's cause, an exception group's first."""
    while True:
        if isinstance(exc, RayTaskError) and getattr(exc, "cause", None) is not None and exc.cause is not exc:
            exc = exc.cause
        elif isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]
        else:
            return exc


def _loc(loc: tuple) -> str:
    # Union members show up in the location ("stop.list[str]", "max_tokens.constrained-int"): not
    # a field the client wrote.
    parts = [str(p) for p in loc if p != "body" and not _is_union_tag(p)]
    return ".".join(parts) if parts else "body"


def _is_union_tag(p: object) -> bool:
    return isinstance(p, str) and (p in ("str", "int", "float", "bool") or "[" in p or p.startswith("constrained-"))


def from_validation_error(e: ValidationError | RequestValidationError) -> APIError:
    # A value that fits no member of a union fails once per member; the member whose type
    # matched says what is wrong ("at most 16 items"), the others only "not a string".
    errs = sorted(e.errors(), key=lambda x: str(x.get("type", "")).endswith("_type"))
    first = errs[0] if errs else {"loc": (), "msg": str(e)}
    param = _loc(tuple(first.get("loc", ())))
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return APIError(400, f"Invalid value for '{param}': {first.get('msg')}{more}", param=param)


M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], body: Any) -> M:
    """`model.model_validate(body)`, where a validation error is an InvalidRequestError naming the
    field: what Python-handle callers catch for any bad value, and a 400 (TGI: 422) over HTTP."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = from_validation_error(e)
        raise InvalidRequestError(err.message, param=err.param) from None


def to_api_error(exc: BaseException) -> APIError:
    """Map anything raised while serving a request to an APIError."""
    exc = _unwrap(exc)
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, OverloadedError):
        return APIError(429, str(exc), code="rate_limit_exceeded", headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, AdapterNotFoundError):
        return APIError(404, str(exc), param=exc.param, code="model_not_found")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, (ValidationError, RequestValidationError)):
        return from_validation_error(exc)
    if isinstance(exc, EngineDeadError):
        # Ray's text names actors, nodes and addresses: the body says what happened in our own
        # words, the log line has the rest under the same incident id.
        incident = uuid.uuid4().hex[:16]
        log.warning("engine unavailable, incident %s: %s", incident, exc)
        public = getattr(exc, "public_message", None) or "the engine replica serving this request is unavailable"
        return APIError(503, f"{public}; retry later (incident {incident})")
    if isinstance(exc, TimeoutError):
        return APIError(504, "the request timed out", code="timeout")
    # The body names no exception internals; the log line carries them under the same id.
    incident = uuid.uuid4().hex[:16]
    log.error("internal error %s", incident, exc_info=exc)
    return APIError(500, f"internal server error (incident {incident}; details are in the server log)")


def is_tgi_path(path: str) -> bool:
    return path == "/" or path.startswith(TGI_PATHS)


def error_response(exc: BaseException, path: str) -> JSONResponse:
    err = to_api_error(exc)
    if is_tgi_path(path):
        return JSONResponse(err.tgi_body(), status_code=err.tgi_status(), headers=err.headers)
    return JSONResponse(err.openai_body(), status_code=err.status, headers=err.headers)


def api_path(request: Request) -> str:
    """The route path without the app's route prefix (Serve's root_path)."""
    path, root = request.url.path, request.scope.get("root_path", "") or ""
    if root and path.startswith(root):
        return path[len(root) :] or "/"
    return path


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return error_response(exc, api_path(request))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(exc, api_path(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail)), api_path(request))

    @app.exception_handler(Exception)
    async def _other(request: Request, exc: Exception):
        return error_response(exc, api_path(request))


async def read_json(request: Request, limit: int) -> Any:
    """The request body as JSON, at most `limit` bytes (413 past it, 400 if not JSON, 415 unless
    the Content-Type is JSON: a browser may post a form or a typeless beacon cross-site, never JSON)."""
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):  # none at all included (a beacon)
        raise APIError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body is {length} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # deeper nesting than the parser's stack allows
        raise APIError(400, "the request body is not valid JSON: nested too deeply") from None


def error_status(out: object) -> int:
    """HTTP status of a request the engine failed (engine.outputs.RequestOutput.error_kind):
    "invalid" 400, "unavailable" 503, "internal" 500 (its step failed: engine/core/step_faults.py)."""
    return {"unavailable": 503, "internal": 500}.get(getattr(out, "error_kind", "invalid"), 400)
