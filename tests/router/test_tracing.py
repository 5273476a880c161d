"""OpenTelemetry traces of a request's path (router/tracing.py).

Unit tests (no Ray): off by default, no exporter or span then; on, a request's span is the child
of the client's W3C traceparent and the engine replica's span keeps its step events bounded.
End to end (slow): an app of the chat stand-in sends its spans over OTLP/HTTP to a small
collector in this process; one chat completion with a client traceparent makes one tree under
the client's span across the router and engine replica processes."""

from __future__ import annotations

import gzip
import http.server
import threading
import time

import httpx
import pytest

import router.tracing as tracing
from tests.router.conftest import BASE

# The short chat prompt below is 36 tokens with the template, the long one 79; after the short
# one, 32 of the long one's are cached (two 16-token blocks): 47 to compute, above this.
LOCAL_PREFILL = 40

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
OTEL_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def _traceparent(trace_id: str = CLIENT_TRACE, span_id: str = CLIENT_SPAN) -> str:
    return f"00-{trace_id}-{span_id}-01"


@pytest.fixture
def clean_tracing(monkeypatch):
    """This process with tracing off and no OTEL_* endpoint; off again afterwards."""
    for name in (*OTEL_ENDPOINT_VARS, "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    tracing.shutdown()
    yield
    tracing.shutdown()


class _RecordingExporter:
    """Stands in for the OTLP exporter: records that it was made and what it got."""

    made: list[dict] = []

    def __init__(self, endpoint=None, **kw) -> None:
        type(self).made.append({"endpoint": endpoint})
        self.spans = []

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.spans += spans
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def test_off_by_default_no_exporter_no_span(clean_tracing, monkeypatch):
    import opentelemetry.exporter.otlp.proto.http.trace_exporter as otlp

    _RecordingExporter.made = []
    monkeypatch.setattr(otlp, "OTLPSpanExporter", _RecordingExporter)
    assert tracing.setup("router", None) is False
    assert not tracing.enabled() and tracing._provider is None
    assert _RecordingExporter.made == []
    assert tracing.start_server_span("POST /v1/chat/completions", {"traceparent": _traceparent()}) is None
    assert tracing.start_span("orbital.route", _traceparent()) is None
    assert tracing.current_span() is None and tracing.traceparent(None) is None
    assert tracing.EngineRequestTrace.start(_traceparent(), {}, 3) is None
    # A disabled SDK stays off even with an endpoint.
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.setup("engine", "http://127.0.0.1:9/v1/traces") is False
    assert _RecordingExporter.made == []
    # The control: an endpoint (the setting, or the standard variable) makes the exporter.
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    assert tracing.setup("engine", "http://127.0.0.1:9/v1/traces") is True
    assert _RecordingExporter.made == [{"endpoint": "http://127.0.0.1:9/v1/traces"}]
    tracing.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    assert tracing.wanted(None) and tracing.setup("router") is True
    assert _RecordingExporter.made[-1] == {"endpoint": None}  # the exporter reads the variable itself


def test_spans_follow_the_client_traceparent(clean_tracing):
    exporter = _RecordingExporter()
    assert tracing.setup("router", exporter=exporter)
    server = tracing.start_server_span("POST /v1/chat/completions", {"traceparent": _traceparent()})
    with tracing.use(server):
        assert tracing.current_span() is server
        parent = tracing.current_span()
    route = tracing.start_span("orbital.route", parent, {"orbital.attempt": 0})
    tracing.end(route, {"orbital.replica": "r1"})
    header = tracing.traceparent(server)
    assert header.startswith(f"00-{CLIENT_TRACE}-") and header.endswith("-01")
    engine = tracing.EngineRequestTrace.start(header, {"orbital.replica": "r1"}, prompt_tokens=7)
    steps = tracing.MAX_STEP_EVENTS + 10
    for i in range(steps):
        engine.output(1, 0.25 if i == 0 else None, 16, "length" if i == steps - 1 else None, i + 1, 3)
    engine.close()
    tracing.end(server, {"http.response.status_code": 200})
    tracing.end(server)  # ended already: nothing
    tracing.flush()
    spans = {s.name: s for s in exporter.spans}
    assert set(spans) == {"POST /v1/chat/completions", "orbital.route", "orbital.engine", "orbital.engine.queue"}
    assert {s.context.trace_id for s in exporter.spans} == {int(CLIENT_TRACE, 16)}
    srv = spans["POST /v1/chat/completions"]
    assert srv.parent.span_id == int(CLIENT_SPAN, 16) and srv.parent.is_remote
    assert spans["orbital.route"].parent.span_id == srv.context.span_id
    eng = spans["orbital.engine"]
    assert eng.parent.span_id == srv.context.span_id
    assert spans["orbital.engine.queue"].parent.span_id == eng.context.span_id
    q = spans["orbital.engine.queue"]
    assert abs((q.end_time - q.start_time) / 1e9 - 0.25) < 1e-3
    a = eng.attributes
    assert a["gen_ai.usage.input_tokens"] == 7 and a["gen_ai.usage.output_tokens"] == steps
    assert a["orbital.engine.steps"] == steps and a["orbital.cached_tokens"] == 16
    assert a["orbital.queue_time_s"] == 0.25 and tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert len(eng.events) == tracing.MAX_STEP_EVENTS  # bounded; the rest are counted
    assert eng.events[0].attributes["orbital.batch_size"] == 3
    assert srv.resource.attributes["service.name"] == "orbital-router"


def test_a_client_that_samples_out_is_honoured(clean_tracing):
    """traceparent flags 00: the router's span is not recorded, nor are the engine's."""
    exporter = _RecordingExporter()
    assert tracing.setup("router", exporter=exporter)
    server = tracing.start_server_span("POST /v1/completions", {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"})
    assert not server.is_recording()
    assert tracing.EngineRequestTrace.start(tracing.traceparent(server), {}, 3) is None
    tracing.end(server)
    tracing.flush()
    assert exporter.spans == []


# --- end to end: the router and an engine replica export to a collector here -------------------


class _Collector(http.server.BaseHTTPRequestHandler):
    """OTLP/HTTP (protobuf) traces: each span as a dict in `spans`."""

    spans: list[dict] = []
    lock = threading.Lock()

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        got = []
        for rs in req.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        {
                            "name": s.name,
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(),
                            "attributes": {kv.key: _value(kv.value) for kv in s.attributes},
                            "events": [e.name for e in s.events],
                            "resource": resource,
                        }
                    )
        with self.lock:
            self.spans.extend(got)
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def collector():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    finally:
        server.shutdown()


def test_spans_reach_a_collector_over_otlp_http(clean_tracing, collector):
    """The exporter as deployed (OTLP/HTTP to the setting's endpoint), without Ray."""
    trace_id = "7" * 32
    assert tracing.setup("engine", collector)
    span = tracing.start_server_span("POST /v1/completions", {"traceparent": _traceparent(trace_id)})
    engine = tracing.EngineRequestTrace.start(tracing.traceparent(span), {"orbital.replica": "r1"}, prompt_tokens=5)
    engine.output(1, 0.01, 0, None, 1, 1)
    engine.close()
    tracing.end(span)
    tracing.flush()
    spans = {s["name"]: s for s in _trace(trace_id, {"POST /v1/completions", "orbital.engine"}, timeout_s=10)}
    assert spans["POST /v1/completions"]["parent"] == CLIENT_SPAN
    assert spans["orbital.engine"]["parent"] == spans["POST /v1/completions"]["span_id"]
    assert spans["orbital.engine"]["attributes"]["gen_ai.usage.input_tokens"] == 5
    assert spans["orbital.engine"]["resource"]["service.name"] == "orbital-engine"


def _trace(trace_id: str, want: set[str], timeout_s: float = 60.0) -> list[dict]:
    """The collector's spans of `trace_id`, once spans named `want` are among them (batched
    exports: seconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _Collector.lock:
            spans = [s for s in _Collector.spans if s["trace_id"] == trace_id]
        if want <= {s["name"] for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.25)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_one_tree_under_the_client_span_across_processes(traced_app, stream):
    trace_id = ("5" if stream else "6") * 32
    body = {
        "model": "stand-in",
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(
        f"{traced_app['url']}/v1/chat/completions",
        json=body,
        headers={"traceparent": _traceparent(trace_id)},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    if stream:
        import json

        chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
        usage = chunks[-1]["usage"]
    else:
        usage = r.json()["usage"]

    server_name = "POST /v1/chat/completions"
    spans = _trace(trace_id, {server_name, "orbital.route", "orbital.engine", "orbital.engine.queue"})
    by_name = {s["name"]: s for s in spans}
    assert {server_name, "orbital.route", "orbital.engine", "orbital.engine.queue"} <= set(by_name), spans
    server, route, engine = by_name[server_name], by_name["orbital.route"], by_name["orbital.engine"]

    # One tree under the client's span.
    assert server["parent"] == CLIENT_SPAN
    assert route["parent"] == server["span_id"] and engine["parent"] == server["span_id"]
    assert by_name["orbital.engine.queue"]["parent"] == engine["span_id"]
    ids = {s["span_id"] for s in spans} | {CLIENT_SPAN}
    assert all(s["parent"] in ids for s in spans)

    # Two processes: the router's and the engine replica's.
    assert server["resource"]["service.name"] == "orbital-router"
    assert engine["resource"]["service.name"] == "orbital-engine"
    assert server["resource"]["process.pid"] != engine["resource"]["process.pid"]
    assert route["resource"]["process.pid"] == server["resource"]["process.pid"]

    # The routing decision, and what the engine did.
    assert route["attributes"]["orbital.replica"] == engine["attributes"]["orbital.replica"] != ""
    assert route["attributes"]["orbital.routing.policy"] == "cache-aware"
    assert route["attributes"]["orbital.routing.predicted_cached_tokens"] >= 0
    a = engine["attributes"]
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] > 0
    assert a["orbital.queue_time_s"] >= 0
    assert a["orbital.engine.steps"] == usage["completion_tokens"]  # one token a step, no drafts
    assert engine["events"] == ["orbital.engine.step"] * usage["completion_tokens"]
    assert server["attributes"]["http.response.status_code"] == 200


@pytest.fixture(scope="module")
def traced_app(chat_stand_in, collector):
    """One traced app for every end-to-end test here (an app's start is most of their time):
    disaggregated, so a chat prompt of over LOCAL_PREFILL uncached tokens is prefilled remotely
    and a shorter one on the decode replica, as in a colocated app."""
    from tests.serve_cluster import serve_app

    with serve_app(
        "traced",
        "/traced",
        **BASE,
        model=chat_stand_in,
        served_model_name="stand-in",
        num_replicas=1,
        prefill_replicas=1,
        local_prefill_max_tokens=LOCAL_PREFILL,
        otlp_traces_endpoint=collector,
    ) as app:
        yield app


@pytest.mark.slow
def test_remote_prefill_and_kv_transfer_spans(traced_app):
    """Disaggregated: the decode replica's remote prefill and KV transfer below its engine span,
    and the prefill replica's span below those: three processes, one trace."""
    trace_id = "8" * 32
    body = {
        "model": "stand-in",
        "messages": [{"role": "user", "content": "Tell me a long story about the sea and its boats. " * 4}],
        "max_tokens": 3,
        "temperature": 0,
    }
    r = httpx.post(
        f"{traced_app['url']}/v1/chat/completions",
        json=body,
        headers={"traceparent": _traceparent(trace_id)},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    want = {
        "POST /v1/chat/completions",
        "orbital.engine",
        "orbital.remote_prefill",
        "orbital.kv_transfer",
        "orbital.prefill",
    }
    spans = {s["name"]: s for s in _trace(trace_id, want)}
    assert want <= set(spans), list(spans)
    engine, remote = spans["orbital.engine"], spans["orbital.remote_prefill"]
    assert engine["parent"] == spans["POST /v1/chat/completions"]["span_id"]
    assert remote["parent"] == engine["span_id"]
    assert spans["orbital.kv_transfer"]["parent"] == remote["span_id"]
    assert spans["orbital.prefill"]["parent"] == remote["span_id"]
    assert spans["orbital.kv_transfer"]["attributes"]["orbital.blocks"] > 0
    assert remote["attributes"]["orbital.prefill_replica"] == spans["orbital.prefill"]["attributes"]["orbital.replica"]
    pids = {
        spans[n]["resource"]["process.pid"] for n in ("POST /v1/chat/completions", "orbital.engine", "orbital.prefill")
    }
    assert len(pids) == 3
