"""One measured run (``measure``) and a sweep of runs over rates or concurrencies."""

from __future__ import annotations

import json
import os
from typing import Callable

from loadtest import SCHEMA_VERSION, servermetrics
from loadtest.arrivals import Arrival, ClosedLoop, Poisson, load_of
from loadtest.client import ClientConfig
from loadtest.metrics import SLO
from loadtest.result import SWEEP_KIND, make_result, save
from loadtest.runner import run
from loadtest.workloads import RequestSpec


def measure(
    specs: list[RequestSpec],
    cfg: ClientConfig,
    arrival: Arrival,
    slo: SLO,
    config: dict,
    label: str | None = None,
    scrape: bool = True,
    series_interval_s: float = 1.0,
    **run_kw,
) -> dict:
    """Run once and return the result dict (with /metrics prefix-cache deltas, and the server's
    figures every `series_interval_s` during the run, when the server exports them)."""
    before = servermetrics.scrape(cfg.root, headers=cfg.headers()) if scrape else {}
    poller = servermetrics.SeriesPoller(cfg.root, series_interval_s, cfg.headers()).start() if scrape else None
    try:
        out = run(specs, cfg, arrival, **run_kw)
    finally:
        series = poller.stop() if poller is not None else {}
    after = servermetrics.scrape(cfg.root, headers=cfg.headers()) if scrape else {}
    config = dict(config, arrival=arrival.describe())
    return make_result(config, out, slo, label, servermetrics.delta(before, after), series or None)


def arrival_for(over: str, value: float, seed: int) -> Arrival:
    if over == "concurrency":
        return ClosedLoop(int(value))
    if over == "rate":
        return Poisson(value, seed)
    raise ValueError(f"sweep over 'concurrency' or 'rate', not {over!r}")


def sweep(
    specs_for: Callable[[float], list[RequestSpec]],
    cfg: ClientConfig,
    over: str,
    values: list[float],
    slo: SLO,
    config: dict,
    out_dir: str,
    seed: int = 0,
    label: str = "sweep",
    scrape: bool = True,
    **run_kw,
) -> dict:
    """Run every point, save each result as ``<out_dir>/<over>_<value>.json`` and the summary as
    ``<out_dir>/sweep.json``. ``specs_for(value)`` gives the request list of a point."""
    os.makedirs(out_dir, exist_ok=True)
    points = []
    for v in values:
        arr = arrival_for(over, v, seed)
        name = f"{over}_{v:g}"
        res = measure(
            specs_for(v), cfg, arr, slo, config, label=f"{label} {over}={v:g}", scrape=scrape, desc=name, **run_kw
        )
        path = save(res, os.path.join(out_dir, name + ".json"))
        points.append(
            {
                "value": v,
                "load": load_of(arr),
                "label": res["label"],
                "result_file": os.path.basename(path),
                "aggregates": res["aggregates"],
                "server_metrics": res["server_metrics"],
            }
        )
    summary = {
        "schema_version": SCHEMA_VERSION,
        "kind": SWEEP_KIND,
        "label": label,
        "over": over,
        "config": config,
        "points": points,
    }
    save(summary, os.path.join(out_dir, "sweep.json"))
    return summary


def sweep_table(sweep_result: dict, markdown: bool = True) -> str:
    """Load vs throughput, TTFT and TPOT percentiles, goodput, errors."""
    head = [
        sweep_result["over"],
        "ok/total",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p95",
        "TTFT p99",
        "TPOT p50",
        "TPOT p95",
        "TPOT p99",
        "E2E p50",
        "goodput",
    ]
    rows = []
    for p in sweep_result["points"]:
        a = p["aggregates"]
        f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        rows.append(
            [
                f"{p['value']:g}",
                f"{a['succeeded']}/{a['requests']}",
                f"{a['req_s']:.2f}",
                f"{a['output_tok_s']:.1f}",
                f(a["ttft_ms"]["p50"]),
                f(a["ttft_ms"].get("p95")),
                f(a["ttft_ms"]["p99"]),
                f(a["tpot_ms"]["p50"]),
                f(a["tpot_ms"].get("p95")),
                f(a["tpot_ms"]["p99"]),
                f(a["e2e_ms"]["p50"]),
                f"{100 * a['goodput']['share']:.0f}%",
            ]
        )
    if markdown:
        return "\n".join(
            ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
        )
    w = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(wi) for c, wi in zip(r, w)) for r in [head] + rows)


def load_sweep(path: str) -> dict:
    with open(path) as f:
        s = json.load(f)
    if s.get("kind") != SWEEP_KIND or s.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{path}: not a sweep file of schema {SCHEMA_VERSION}")
    return s
