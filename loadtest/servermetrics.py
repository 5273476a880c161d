"""Optional: prefix-cache counters from the server's Prometheus /metrics, before and after a run.

Counters whose name contains ``prefix_cache_hits`` / ``prefix_cache_queries`` are summed
(vLLM: ``vllm:prefix_cache_hits_total`` and ``vllm:prefix_cache_queries_total``, in tokens).
"""

from __future__ import annotations

import re

import httpx

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse(text: str) -> dict[str, float]:
    out = {"prefix_cache_hits": 0.0, "prefix_cache_queries": 0.0}
    found = False
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or m.group(1).endswith("_created"):
            continue
        for key in out:
            if key in m.group(1):
                out[key] += float(m.group(3))
                found = True
    return out if found else {}


def scrape(root: str, timeout: float = 30.0) -> dict[str, float]:
    try:
        r = httpx.get(root.rstrip("/") + "/metrics", timeout=timeout)
        return parse(r.text) if r.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


def delta(before: dict, after: dict) -> dict | None:
    if not before or not after:
        return None
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    q = d.get("prefix_cache_queries", 0.0)
    d["prefix_cache_hit_rate"] = d.get("prefix_cache_hits", 0.0) / q if q > 0 else None
    return d
