"""OpenTelemetry traces of a request's path through the router and the engine replicas.

Off unless a process is given an OTLP endpoint: `AppConfig.otlp_traces_endpoint` (handed to the
router and every engine replica), or the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` /
`OTEL_EXPORTER_OTLP_ENDPOINT` variables where the process runs. `OTEL_SDK_DISABLED=true` or
`OTEL_TRACES_EXPORTER=none` keep it off. Everything else (headers, timeout, compression, sampler,
batch sizes and delays, resource attributes, service name) is the SDK's, from the `OTEL_*`
variables. Spans go out over OTLP/HTTP (protobuf) from a batch processor.

Each Serve replica process calls `setup` once at construction (the router's ingress, the engine
replicas). Off, every helper here returns None or does nothing: no tracer provider, no exporter,
no span objects, no trace context on the messages.

Spans (attribute names under `orbital.` unless a semantic convention has one):
  * router: the HTTP request (SERVER, child of the client's W3C `traceparent` when it sends one),
    below it one `orbital.route` per submit (the replica choice and the submit call: the chosen
    replica, policy, predicted cached tokens) and an `orbital.migration` event per failover move;
  * engine replica: `orbital.engine` (SERVER, child of the router's request span: the trace
    context rides in `SubmitRequest.traceparent`): prompt, output and cached tokens, queue time,
    time to first token, steps, finish reason; a child `orbital.engine.queue` span for the wait
    before the first schedule; one `orbital.engine.step` event per engine step the request got
    tokens from, the first MAX_STEP_EVENTS of them (the rest counted);
  * disaggregated serving: `orbital.remote_prefill` (decode replica, below `orbital.engine`) with
    a child `orbital.kv_transfer`, and `orbital.prefill` in the prefill replica below it;
  * a fetch from a peer: `orbital.peer_fetch` (below `orbital.engine`): the holder, blocks, bytes.
The engine itself knows nothing of this: the replica builds its spans from the outputs and
times the engine already reports.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, ContextManager, Mapping

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
# Step events one engine span carries; a longer request counts the rest (`orbital.engine.steps`).
MAX_STEP_EVENTS = 64
SERVICE_NAMES = {"router": "orbital-router", "engine": "orbital-engine"}

_lock = threading.Lock()
_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None
_propagator = TraceContextTextMapPropagator()


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() == "true"


def wanted(endpoint: str | None) -> bool:
    """Whether this process should trace: an endpoint given (the setting) or named by the
    standard variables, and the SDK not disabled."""
    if _env_on("OTEL_SDK_DISABLED") or os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(
        endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def setup(role: str, endpoint: str | None = None, exporter: SpanExporter | None = None) -> bool:
    """Start tracing in this process, once (later calls return the first one's answer when it
    turned tracing on). `role`: "router" or "engine" (the default service name); `endpoint`: the
    OTLP/HTTP traces URL (None: the OTEL_* variables'). `exporter`: one of the caller's instead
    of OTLP (tests). Returns whether this process traces."""
    global _provider, _tracer
    with _lock:
        if _tracer is not None:
            return True
        if exporter is None and not wanted(endpoint):
            return False
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create({"process.pid": os.getpid(), "orbital.role": role})
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: SERVICE_NAMES.get(role, f"orbital-{role}")}))
        if exporter is None:
            protocol = os.environ.get(
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
            )
            if protocol.strip() != "http/protobuf":
                log.warning("OTLP protocol %r is not supported here: traces go out as http/protobuf", protocol)
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint or None)
        provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER (parent-based)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        _provider, _tracer = provider, provider.get_tracer("orbital")
        log.info("tracing on (%s): spans to %s", role, endpoint or "the OTEL_EXPORTER_OTLP_* endpoint")
        return True


def enabled() -> bool:
    return _tracer is not None


def flush(timeout_s: float = 5.0) -> None:
    """Export what is buffered now (tests, shutdown)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def shutdown() -> None:
    """Stop tracing in this process (tests): flush, close the exporter, back to off."""
    global _provider, _tracer
    with _lock:
        if _provider is not None:
            _provider.shutdown()
        _provider = _tracer = None


def _ns(wall_s: float | None) -> int | None:
    return None if wall_s is None else int(wall_s * 1e9)


def _context(parent: Span | str | None):
    if isinstance(parent, str):
        return _propagator.extract({TRACEPARENT: parent})
    if parent is not None:
        return trace.set_span_in_context(parent)
    return None  # the current context


def start_server_span(name: str, headers: Mapping[str, str], attributes: dict | None = None) -> Span | None:
    """An incoming request's span, the child of its `traceparent` header (W3C trace context;
    a root span without one). None when tracing is off."""
    if _tracer is None:
        return None
    carrier = {k: headers[k] for k in (TRACEPARENT, "tracestate") if k in headers}
    return _tracer.start_span(name, context=_propagator.extract(carrier), kind=SpanKind.SERVER, attributes=attributes)


def start_span(
    name: str,
    parent: Span | str | None,
    attributes: dict | None = None,
    start_wall: float | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> Span | None:
    """A span below `parent` (a span, a traceparent string, None: the current span), starting at
    `start_wall` (time.time(); None: now). None when tracing is off or there is no parent."""
    if _tracer is None or (parent is None and not trace.get_current_span().get_span_context().is_valid):
        return None
    return _tracer.start_span(
        name, context=_context(parent), kind=kind, attributes=attributes, start_time=_ns(start_wall)
    )


def end(
    span: Span | None,
    attributes: dict | None = None,
    error: BaseException | str | None = None,
    end_wall: float | None = None,
) -> None:
    """End `span` (None, or ended already: nothing), with attributes and an error status."""
    if span is None or not span.is_recording():
        return
    if attributes:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
    if error is not None:
        span.set_status(
            Status(StatusCode.ERROR, error if isinstance(error, str) else f"{type(error).__name__}: {error}")
        )
    span.end(end_time=_ns(end_wall))


def event(span: Span | None, name: str, attributes: dict | None = None) -> None:
    if span is not None and span.is_recording():
        span.add_event(name, {k: v for k, v in (attributes or {}).items() if v is not None})


def current_span() -> Span | None:
    """The span the running task is in (None: off, or none)."""
    if _tracer is None:
        return None
    span = trace.get_current_span()
    return span if span.get_span_context().is_valid else None


def use(span: Span | None) -> ContextManager:
    """Make `span` the current one for a block (it is not ended at the block's end)."""
    return nullcontext() if span is None else trace.use_span(span, end_on_exit=False)


def traceparent(span: Span | None) -> str | None:
    """`span`'s W3C traceparent (what the messages to the replicas carry)."""
    if span is None:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT)


class EngineRequestTrace:
    """An engine replica's span of one request, built from the outputs the engine reports: the
    replica calls `output` for each one and `close` at the end."""

    __slots__ = ("span", "arrival_wall", "prompt_tokens", "output_tokens", "steps", "cached", "first_token", "reasons")

    def __init__(self, span: Span, arrival_wall: float, prompt_tokens: int) -> None:
        self.span, self.arrival_wall, self.prompt_tokens = span, arrival_wall, prompt_tokens
        self.output_tokens = self.steps = self.cached = 0
        self.first_token: float | None = None
        self.reasons: set[str] = set()

    @classmethod
    def start(cls, traceparent: str | None, attributes: dict, prompt_tokens: int) -> EngineRequestTrace | None:
        """None unless tracing is on here and the router sent a sampled trace context."""
        if _tracer is None or not traceparent:
            return None
        now = time.time()
        span = start_span("orbital.engine", traceparent, attributes, start_wall=now, kind=SpanKind.SERVER)
        return None if span is None or not span.is_recording() else cls(span, now, prompt_tokens)  # sampled out

    def output(
        self,
        new_tokens: int,
        queue_time: float | None,
        cached: int,
        finish_reason: str | None,
        step: int,
        batch_size: int,
    ) -> None:
        """One engine output of the request (`step`: the engine's step count when the replica
        took it; `batch_size`: the running batch then)."""
        now = time.time()
        if queue_time is not None and self.first_token is None:
            queued = start_span("orbital.engine.queue", self.span, start_wall=self.arrival_wall)
            end(queued, end_wall=self.arrival_wall + max(0.0, queue_time))
            self.span.set_attribute("orbital.queue_time_s", max(0.0, queue_time))
        self.cached = max(self.cached, cached)
        if finish_reason:
            self.reasons.add(finish_reason)
        if not new_tokens:
            return
        if self.first_token is None:
            self.first_token = now
        self.output_tokens += new_tokens
        self.steps += 1
        if self.steps <= MAX_STEP_EVENTS:
            self.span.add_event(
                "orbital.engine.step",
                {"orbital.step": step, "orbital.batch_size": batch_size, "orbital.new_tokens": new_tokens},
            )

    def close(self, error: BaseException | str | None = None, aborted: bool = False) -> None:
        end(
            self.span,
            {
                "gen_ai.usage.input_tokens": self.prompt_tokens,
                "gen_ai.usage.output_tokens": self.output_tokens,
                "orbital.cached_tokens": self.cached,
                "orbital.engine.steps": self.steps,
                "orbital.time_to_first_token_s": None
                if self.first_token is None
                else self.first_token - self.arrival_wall,
                "gen_ai.response.finish_reasons": sorted(self.reasons) or None,
                "orbital.aborted": aborted or None,
            },
            error=error,
        )


def attributes_of(**kw: Any) -> dict:
    """`orbital.<name>` attributes of the keywords that are not None."""
    return {f"orbital.{k}": v for k, v in kw.items() if v is not None}
