"""The result file: config, per-request records, aggregates, with a schema version."""

from __future__ import annotations

import json
import math
import os
import platform
import time

from loadtest import SCHEMA_VERSION
from loadtest.metrics import SLO, aggregate
from loadtest.records import RequestRecord
from loadtest.runner import RunOutput

KIND = "orbital.loadtest.result"
SWEEP_KIND = "orbital.loadtest.sweep"


def make_result(
    config: dict,
    run: RunOutput,
    slo: SLO,
    label: str | None = None,
    server_metrics: dict | None = None,
    server_series: dict | None = None,
) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": KIND,
        "label": label or config.get("workload", {}).get("name", "run"),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(run.started_at)),
        "host": platform.node(),
        "model": run.model,
        "config": config,
        "aggregates": aggregate(run.records, run.duration_s, slo, run.not_sent),
        "server_metrics": server_metrics,
        "server_series": server_series,
        "requests": [r.to_dict() for r in run.records],
    }


def save(result: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_clean(result), f, indent=1, allow_nan=False)
    os.replace(tmp, path)
    return path


def _clean(o):
    """Strict JSON: inf/nan (an unbounded rate, say) become strings."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def load(path: str, kind: str = KIND) -> dict:
    with open(path) as f:
        result = json.load(f)
    if result.get("kind") != kind:
        raise ValueError(f"{path}: not a {kind} file (kind={result.get('kind')!r})")
    if result.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema_version {result.get('schema_version')} != {SCHEMA_VERSION}")
    return result


def records_of(result: dict) -> list[RequestRecord]:
    return [RequestRecord.from_dict(d) for d in result["requests"]]
