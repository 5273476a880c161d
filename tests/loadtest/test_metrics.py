"""Metric arithmetic on hand-made timelines."""

import numpy as np
import pytest

from loadtest.metrics import SLO, aggregate, stats_ms, throughput_series
from loadtest.records import RequestRecord


def rec(i, start, ttft, gaps, tokens=None, success=True, kind=None):
    latency = ttft + sum(gaps)
    r = RequestRecord(
        id=f"r{i}",
        start=start,
        ttft=ttft,
        itl=list(gaps),
        latency=latency,
        chunk_tokens=[1] * (len(gaps) + 1),
        output_tokens=tokens or len(gaps) + 1,
        prompt_tokens=10,
        success=success,
    )
    if not success:
        r.fail(kind, "x")
    return r


def test_tpot_is_mean_gap_after_first_token():
    r = rec(0, 0.0, 0.100, [0.020, 0.030, 0.050])
    assert r.tpot == pytest.approx(0.100 / 3)
    assert r.end == pytest.approx(0.2)
    assert r.token_times() == pytest.approx([0.1, 0.12, 0.15, 0.2])
    # usage says more tokens than chunks (several tokens per chunk): TPOT uses the usage count
    assert rec(1, 0.0, 0.1, [0.1], tokens=5).tpot == pytest.approx(0.1 / 4)
    assert rec(2, 0.0, 0.1, []).tpot is None  # one token: no TPOT
    assert rec(3, 0.0, 0.1, [0.1], success=False, kind="http_500").tpot is None


def test_percentiles_linear_interpolation():
    s = stats_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert s["p50"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01)
    assert s["mean"] == pytest.approx(50.5) and s["min"] == pytest.approx(1) and s["max"] == pytest.approx(100)
    assert s["count"] == 100
    assert stats_ms([])["p50"] is None
    assert stats_ms([0.004, 0.001, 0.002, 0.003])["p50"] == pytest.approx(2.5)


def test_aggregate_goodput_throughput_and_errors():
    records = [
        rec(0, 0.0, 0.100, [0.020] * 9),  # ttft 100 ms, tpot 20 ms, 10 tokens: good
        rec(1, 0.5, 0.300, [0.020] * 9),  # ttft 300 ms: misses the TTFT SLO
        rec(2, 1.0, 0.100, [0.050] * 9),  # tpot 50 ms: misses the TPOT SLO
        rec(3, 1.5, 0.150, []),  # one token, no TPOT: good
        rec(4, 1.6, 0.050, [0.01], success=False, kind="stream_dropped"),
        rec(5, 1.7, 0.050, [0.01], success=False, kind="http_500"),
        rec(6, 1.8, 0.050, [0.01], success=False, kind="http_500"),
    ]
    a = aggregate(records, duration_s=2.0, slo=SLO(ttft_ms=200, tpot_ms=40))
    assert (a["requests"], a["succeeded"], a["failed"]) == (7, 4, 3)
    assert a["errors_by_kind"] == {"http_500": 2, "stream_dropped": 1}
    assert a["goodput"]["good"] == 2
    assert a["goodput"]["share"] == pytest.approx(2 / 7)
    assert a["goodput"]["req_s"] == pytest.approx(1.0)
    assert a["output_tokens"] == 31 and a["prompt_tokens"] == 40
    assert a["output_tok_s"] == pytest.approx(15.5)
    assert a["total_tok_s"] == pytest.approx(35.5)
    assert a["req_s"] == pytest.approx(2.0)
    assert a["ttft_ms"]["p50"] == pytest.approx(125.0)  # of 100, 300, 100, 150
    assert a["tpot_ms"]["p50"] == pytest.approx(20.0)  # of 20, 20, 50
    assert a["tpot_ms"]["p99"] == pytest.approx(49.4)  # 20 + 0.98 * 30
    assert a["tpot_ms"]["mean"] == pytest.approx(30.0)
    assert a["itl_ms"]["count"] == 27
    # no SLO given: every success is good
    assert aggregate(records, 2.0)["goodput"]["good"] == 4
    # an e2e SLO alone
    assert aggregate(records, 2.0, SLO(e2e_ms=300))["goodput"]["good"] == 2


def test_prefix_cache_hit_rate_from_usage():
    a, b = rec(0, 0, 0.1, [0.1]), rec(1, 0, 0.1, [0.1])
    a.cached_tokens, b.cached_tokens = 10, 0
    a.prompt_tokens, b.prompt_tokens = 20, 20
    assert aggregate([a, b], 1.0)["prefix_cache"]["hit_rate"] == pytest.approx(0.25)
    assert aggregate([rec(2, 0, 0.1, [])], 1.0)["prefix_cache"] is None


def test_throughput_series_sums_to_output_tokens():
    records = [rec(0, 0.0, 0.5, [0.5, 0.5]), rec(1, 1.2, 0.3, [0.2], tokens=4)]
    t, tps = throughput_series(records, bin_s=0.5)
    assert tps.sum() * 0.5 == pytest.approx(7.0)
    assert t[0] == 0.0 and len(t) == len(tps)


def test_p95_and_per_request_rate_in_aggregates():
    recs = [
        RequestRecord(
            id=f"r{i}", success=True, prompt_tokens=10, output_tokens=10, ttft=0.01 * (i + 1), latency=0.1 * (i + 1)
        )
        for i in range(20)
    ]
    a = aggregate(recs, duration_s=2.0)
    assert a["ttft_ms"]["p95"] == pytest.approx(np.percentile([10.0 * (i + 1) for i in range(20)], 95))
    assert a["e2e_ms"]["p90"] < a["e2e_ms"]["p95"] < a["e2e_ms"]["p99"]
    rates = [10 / (0.1 * (i + 1)) for i in range(20)]
    assert a["request_tok_s"]["p50"] == pytest.approx(np.percentile(rates, 50))
    assert a["request_tok_s"]["max"] == pytest.approx(100.0)


def test_server_series_from_orbitals_own_metrics_page():
    """The poller reads the names the router exports (router/metrics.py), not a guess at them."""
    from loadtest.servermetrics import parse_series, to_series
    from router.metrics import render
    from tests.router.test_units import _replica

    page = lambda **kw: render("m", [_replica(**kw), _replica()], {}).decode()  # noqa: E731
    s1 = parse_series(page())
    assert s1["num_running"] == 4 and s1["num_waiting"] == 2 and s1["kv_cache_usage"] == pytest.approx(0.1)
    assert s1["preemptions"] == 2 and s1["prefix_queries"] == 128 and s1["prefix_hits"] == 32
    s2 = parse_series(page(num_running=6, num_preemptions=4, prefix_cache_queries=164, prefix_cache_hits=52))
    series = to_series([(0.0, s1), (1.0, {}), (2.0, s2)], 1.0)
    assert series["t"] == [0.0, 1.0, 2.0]
    assert series["num_running"] == [4, None, 8]  # a failed scrape is a gap, not a zero
    assert series["preemptions"] == [0, None, 3]
    assert series["prefix_hit_rate"] == [None, None, pytest.approx(36 / 100)]  # this interval: 36 of 100 hit
    assert to_series([(0.0, {}), (1.0, {})], 1.0) == {}  # a server without these series
