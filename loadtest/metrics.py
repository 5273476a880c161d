"""Aggregates over request records: percentiles, throughput, goodput under SLOs, errors by kind."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from loadtest.records import RequestRecord

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class SLO:
    """A request is *good* when it succeeded and meets every bound given (milliseconds)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        if not r.success:
            return False
        if self.ttft_ms is not None and (r.ttft is None or r.ttft * 1e3 > self.ttft_ms):
            return False
        tpot = r.tpot
        if self.tpot_ms is not None and tpot is not None and tpot * 1e3 > self.tpot_ms:
            return False  # a one-token answer has no TPOT and cannot miss it
        if self.e2e_ms is not None and (r.latency is None or r.latency * 1e3 > self.e2e_ms):
            return False
        return True


def stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean/min/max/p50/p90/p95/p99 in milliseconds (linear interpolation, as numpy and vLLM)."""
    return stats(values_s, 1e3)


def stats(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean/min/max and the PERCENTILES of values * scale."""
    keys = ["mean", "min", "max"] + [f"p{p}" for p in PERCENTILES]
    if not values:
        return {k: None for k in keys} | {"count": 0}
    a = np.asarray(values, dtype=float) * scale
    out = {"mean": float(a.mean()), "min": float(a.min()), "max": float(a.max())}
    out |= {f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}
    return out | {"count": int(a.size)}


def aggregate(records: list[RequestRecord], duration_s: float, slo: SLO = SLO(), not_sent: int = 0) -> dict:
    ok = [r for r in records if r.success]
    n = len(records)
    dur = max(duration_s, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    good = sum(slo.met_by(r) for r in records)
    cached = [r for r in ok if r.cached_tokens is not None]
    prefix = None
    if cached:
        c, p = sum(r.cached_tokens for r in cached), sum(r.prompt_tokens for r in cached)
        prefix = {"cached_tokens": c, "prompt_tokens": p, "hit_rate": c / p if p else 0.0}
    return {
        "requests": n,
        "succeeded": len(ok),
        "failed": n - len(ok),
        "not_sent": not_sent,
        "errors_by_kind": dict(sorted(Counter(r.error_kind for r in records if not r.success).items())),
        "duration_s": duration_s,
        "ttft_ms": stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": stats_ms([g for r in ok for g in r.itl]),
        "e2e_ms": stats_ms([r.latency for r in ok if r.latency is not None]),
        # Each request's own output rate: its output tokens over its end-to-end latency.
        "request_tok_s": stats([r.output_tokens / r.latency for r in ok if r.latency and r.output_tokens]),
        "output_tokens": out_tokens,
        "prompt_tokens": in_tokens,
        "output_tok_s": out_tokens / dur,
        "total_tok_s": (out_tokens + in_tokens) / dur,
        "req_s": len(ok) / dur,
        "goodput": {"slo": asdict(slo), "good": good, "share": good / n if n else 0.0, "req_s": good / dur},
        "usage_reported": sum(r.usage_reported for r in ok),
        "prefix_cache": prefix,
    }


def throughput_series(records: list[RequestRecord], bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(bin start times, output tokens/s per bin) from chunk arrival times of successful requests.
    A chunk's tokens are scaled so each request's total matches its (usage) output count."""
    times, weights = [], []
    for r in records:
        if not r.success:
            continue
        ts = r.token_times()
        if ts:
            times += ts
            weights += [r.output_tokens / len(ts)] * len(ts)
    if not times:
        return np.zeros(0), np.zeros(0)
    nbins = int(np.ceil(max(times) / bin_s)) or 1
    hist, edges = np.histogram(times, bins=nbins, range=(0, nbins * bin_s), weights=weights)
    return edges[:-1], hist / bin_s


def concurrency_series(records: list[RequestRecord], bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(bin start, mean number of requests in flight during the bin), time-weighted."""
    spans = [(r.start, r.end) for r in records if r.end is not None]
    if not spans:
        return np.zeros(0), np.zeros(0)
    nbins = int(np.ceil(max(e for _, e in spans) / bin_s)) or 1
    t = np.arange(nbins) * bin_s
    busy = np.zeros(nbins)
    for s, e in spans:
        busy += np.clip(np.minimum(t + bin_s, e) - np.maximum(t, s), 0, None)
    return t, busy / bin_s


def auto_bin(records: list[RequestRecord], bins: int = 40) -> float:
    """A round bin width giving about ``bins`` bins over the run."""
    end = max((r.end for r in records if r.end is not None), default=1.0)
    raw = max(end / bins, 1e-3)
    step = 10 ** np.floor(np.log10(raw))
    return float(min((m * step for m in (1, 2, 5, 10) if m * step >= raw), default=raw))
