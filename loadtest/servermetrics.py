"""Optional: the server's own figures from its Prometheus /metrics.

Before and after a run: counters whose name contains ``prefix_cache_hits`` /
``prefix_cache_queries`` are summed (vLLM: ``vllm:prefix_cache_hits_total`` and
``vllm:prefix_cache_queries_total``, in tokens).

During a run (`SeriesPoller`): every `interval_s` the running batch, the queue depth, KV cache
usage, preemptions and the prefix hit rate, as time series for the report and its plots. Names
match Orbital's (``orbital:``) and vLLM's (``vllm:``) series by their suffix.
"""

from __future__ import annotations

import re
import threading
import time

import httpx

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse(text: str) -> dict[str, float]:
    """The prefix-cache counters of a /metrics page ({} when it has none)."""
    s = parse_series(text)
    if "prefix_hits" not in s and "prefix_queries" not in s:
        return {}
    return {"prefix_cache_hits": s.get("prefix_hits", 0.0), "prefix_cache_queries": s.get("prefix_queries", 0.0)}


def scrape(root: str, timeout: float = 30.0, headers: dict | None = None) -> dict[str, float]:
    try:
        r = httpx.get(root.rstrip("/") + "/metrics", timeout=timeout, headers=headers or {})
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


# series key -> (metric name suffixes, how samples over label sets combine)
_SERIES = {
    "num_running": (("num_requests_running",), "sum"),
    "num_waiting": (("num_requests_waiting",), "sum"),
    "kv_cache_usage": (("kv_cache_usage_perc", "gpu_cache_usage_perc"), "mean"),
    "preemptions": (("num_preemptions", "num_preemptions_total"), "sum"),
    "prefix_hits": (("prefix_cache_hits", "prefix_cache_hits_total"), "sum"),
    "prefix_queries": (("prefix_cache_queries", "prefix_cache_queries_total"), "sum"),
}


def parse_series(text: str) -> dict[str, float]:
    """One sample of each series found in a /metrics page (absent series are left out)."""
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        short = m.group(1).rsplit(":", 1)[-1]
        for key, (suffixes, _) in _SERIES.items():
            if short in suffixes:
                found.setdefault(key, []).append(float(m.group(3)))
    return {k: sum(v) if _SERIES[k][1] == "sum" else sum(v) / len(v) for k, v in found.items()}


class SeriesPoller:
    """Scrapes /metrics every `interval_s` on a thread while a run goes on; `stop()` returns the
    series: times since start, and per figure one value per sample (None where a scrape failed).
    Counters become per-run figures: preemptions since the start, the prefix hit rate of each
    interval."""

    def __init__(self, root: str, interval_s: float = 1.0, headers: dict | None = None) -> None:
        self.url, self.interval_s, self.headers = root.rstrip("/") + "/metrics", interval_s, headers or {}
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-poller", daemon=True)
        self._t0 = time.monotonic()

    def start(self) -> SeriesPoller:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def _run(self) -> None:
        with httpx.Client(timeout=max(2.0, self.interval_s), headers=self.headers) as client:
            while True:
                t = time.monotonic() - self._t0
                try:
                    r = client.get(self.url)
                    sample = parse_series(r.text) if r.status_code == 200 else {}
                except httpx.HTTPError:
                    sample = {}
                self.samples.append((t, sample))
                if self._stop.wait(self.interval_s):
                    return

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=10)
        return to_series(self.samples, self.interval_s)


def to_series(samples: list[tuple[float, dict[str, float]]], interval_s: float) -> dict:
    out: dict = {"interval_s": interval_s, "t": [round(t, 3) for t, _ in samples]}
    for key in ("num_running", "num_waiting", "kv_cache_usage"):
        out[key] = [s.get(key) for _, s in samples]
    first = next((s for _, s in samples if "preemptions" in s), None)
    out["preemptions"] = [
        None if first is None or "preemptions" not in s else s["preemptions"] - first["preemptions"] for _, s in samples
    ]
    rates, prev = [], None
    for _, s in samples:
        rate = None
        if prev is not None and "prefix_queries" in s and "prefix_queries" in prev:
            q = s["prefix_queries"] - prev["prefix_queries"]
            rate = (s["prefix_hits"] - prev["prefix_hits"]) / q if q > 0 else None
        rates.append(rate)
        prev = s if "prefix_queries" in s else prev
    out["prefix_hit_rate"] = rates
    if not any(v is not None for k in ("num_running", "num_waiting", "kv_cache_usage") for v in out[k]):
        return {}  # the server exports none of these: no series
    return out
