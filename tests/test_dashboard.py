"""The Grafana dashboard (deploy/grafana/orbital-dashboard.json) asks only for series the server
exports: every metric and label its PromQL names appears on a /metrics page rendered by the
router's own code (router/metrics.py) with every optional family present (P/D roles, routing,
tiers)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from router.metrics import render_pools

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "orbital-dashboard.json"
METRIC = re.compile(r"orbital:[a-z0-9_]+")
SAMPLE = re.compile(r"^(orbital:[a-z0-9_]+)(?:\{(.*)\})? ")


def _exported() -> dict[str, set[str]]:
    """Sample name -> its label names, from a page with every family the server can emit."""
    page = render_pools(
        [("m", [{"replica_id": "r1", "num_blocks": 8, "finished": {"stop": 1}}], {})],
        tier_overflows={("alias", "small", "large", "overload"): 1},
        tier_decisions={("alias", "small", "rule"): 1},
        routing={
            "per_replica": {
                "r1": {"routed": 1, "predicted_cached_tokens": 1, "actual_cached_tokens": 1, "peer_fetches_planned": 1}
            },
            "decision_seconds": 0.1,
            "decisions": 1,
        },
        roles={"prefill": [{}], "decode": [{}]},
    ).decode()
    out: dict[str, set[str]] = {}
    for line in page.splitlines():
        m = SAMPLE.match(line)
        if m:
            labels = {kv.split("=")[0] for kv in (m.group(2) or "").split(",") if kv}
            out.setdefault(m.group(1), set()).update(labels)
    return out


def _queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v.get("definition")]
    return exprs


def test_every_dashboard_query_names_exported_metrics_and_labels():
    exported = _exported()
    queries = _queries()
    assert len(queries) > 30
    for expr in queries:
        names = METRIC.findall(expr)
        assert names, f"no orbital metric in {expr!r}"
        missing = [n for n in names if n not in exported]
        assert not missing, f"{expr!r} names {missing}, which /metrics does not export"
        labels = set().union(*(exported[n] for n in names))
        used = set()
        for group in re.findall(r"by \(([^)]*)\)", expr):
            used |= {x.strip() for x in group.split(",")}
        used |= set(re.findall(r"([a-z_]+)=~?\"", expr))
        used |= set(re.findall(r"label_values\([^,]+, *([a-z_]+)\)", expr))
        assert used <= labels, f"{expr!r} uses labels {sorted(used - labels)} that {names} lack"


def test_the_dashboard_covers_what_operators_look_at():
    text = " ".join(_queries())
    for family in (
        "generation_tokens_total",  # throughput
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "num_requests_waiting",  # queue depth
        "kv_cache_usage_perc",
        "prefix_cache_hits_total",
        "router_actual_cached_tokens_total",  # routing hit rate
        "kv_transfers_total",  # P/D transfers
        "router_migrations_total",  # failovers
        "num_replicas",  # autoscaling
    ):
        assert f"orbital:{family}" in text, family
