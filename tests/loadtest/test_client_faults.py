"""Real HTTP against the fault-injecting server: successes, errors by kind, TTFT/TPOT."""

import socket

from loadtest.arrivals import Burst, ClosedLoop, Poisson
from loadtest.client import ClientConfig
from loadtest.metrics import aggregate
from loadtest.runner import run
from loadtest.workloads import RequestSpec


def spec(i, mode, n=10, chat=False):
    text = f"request {i} MODE:{mode}"
    if chat:
        return RequestSpec(f"{mode}-{i}", n, messages=[{"role": "user", "content": text}], kind=mode)
    return RequestSpec(f"{mode}-{i}", n, prompt=text, kind=mode)


def test_faults_are_errors_by_kind(fake_server):
    modes = ["ok", "ok", "nousage", "fail500", "drop", "error_event", "no_done", "short"]
    specs = [spec(i, m) for i, m in enumerate(modes)] + [spec(9, "ok", chat=True), spec(10, "drop", chat=True)]
    cfg = ClientConfig(base_url=fake_server.url + "/v1", timeout=10)
    out = run(specs, cfg, Poisson(float("inf")), progress=False)
    assert out.model == "fake-model"
    by_id = {r.id: r for r in out.records}
    assert {r.id for r in out.records if r.success} == {"ok-0", "ok-1", "nousage-2", "ok-9"}
    assert by_id["fail500-3"].error_kind == "http_500" and by_id["fail500-3"].http_status == 500
    assert by_id["drop-4"].error_kind == "stream_dropped"
    assert by_id["drop-10"].error_kind == "stream_dropped"
    assert by_id["error_event-5"].error_kind == "stream_error"
    assert by_id["no_done-6"].error_kind == "no_done"
    assert by_id["short-7"].error_kind == "short_output"
    a = aggregate(out.records, out.duration_s)
    assert a["errors_by_kind"] == {
        "http_500": 1,
        "no_done": 1,
        "short_output": 1,
        "stream_dropped": 2,
        "stream_error": 1,
    }
    ok = by_id["ok-0"]
    assert ok.usage_reported and ok.output_tokens == 10 and ok.prompt_tokens == 7 and ok.cached_tokens == 3
    assert not by_id["nousage-2"].usage_reported and by_id["nousage-2"].output_tokens == 10
    assert by_id["ok-9"].output_tokens == 10  # chat: the role-only first chunk is not a token
    for r in (ok, by_id["ok-9"], by_id["nousage-2"]):
        # Lower bounds are the server's sleeps; upper bounds leave room for a loaded 2-core box
        # (11 requests start at once) yet still fail if TTFT were taken at the end of the stream
        # or TPOT over the whole request.
        assert fake_server.ttft * 0.9 <= r.ttft < fake_server.ttft + 2.0
        assert r.ttft <= r.latency - 9 * fake_server.itl * 0.9
        assert fake_server.itl * 0.9 <= r.tpot < fake_server.itl + 0.25
        assert len(r.itl) == 9


def test_short_output_is_success_without_ignore_eos(fake_server):
    cfg = ClientConfig(base_url=fake_server.url, timeout=10, ignore_eos=False)
    out = run([spec(0, "short")], cfg, ClosedLoop(1), progress=False)
    assert out.records[0].success and out.records[0].output_tokens == 5


def test_timeout_and_connect_errors(fake_server):
    cfg = ClientConfig(base_url=fake_server.url, timeout=0.5)
    out = run([spec(0, "slow")], cfg, ClosedLoop(1), progress=False)
    assert out.records[0].error_kind == "timeout"
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    cfg = ClientConfig(base_url=f"http://127.0.0.1:{port}", model="m", timeout=5)
    out = run([spec(1, "ok")], cfg, ClosedLoop(1), progress=False)
    assert out.records[0].error_kind == "connect" and not out.records[0].success


def test_closed_loop_bounds_and_dependencies(fake_server):
    cfg = ClientConfig(base_url=fake_server.url, timeout=10)
    specs = [spec(i, "ok", n=5) for i in range(6)]
    specs[3].depends_on = specs[0].id
    out = run(specs, cfg, ClosedLoop(2), max_requests=5, progress=False)
    assert len(out.records) == 5 and all(r.success for r in out.records)
    by_id = {r.id: r for r in out.records}
    assert by_id["ok-3"].start >= by_id["ok-0"].end - 1e-6
    # in flight never exceeds the concurrency
    spans = [(r.start, r.end) for r in out.records]
    assert max(sum(s <= t < e for s, e in spans) for t, _ in spans) <= 2


def test_duration_bound_stops_sending_and_cancels(fake_server):
    cfg = ClientConfig(base_url=fake_server.url, timeout=10)
    specs = [spec(i, "slow" if i == 0 else "ok", n=3) for i in range(10)]
    out = run(specs, cfg, Burst(2, 0.3), max_duration=0.5, drain_timeout=0.3, progress=False)
    assert out.not_sent == 6  # bursts at 0.0 and 0.3 only
    kinds = {r.id: r.error_kind for r in out.records}
    assert kinds["slow-0"] == "cancelled" and sum(k is None for k in kinds.values()) == 3
    assert out.duration_s < 1.5
