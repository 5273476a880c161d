"""A latency histogram kept as plain numbers: per-bucket counts and a sum, cheap to observe on
the hot path, shipped between processes as a dict and merged over replicas (router/metrics.py
names them and renders them for Prometheus)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket (not cumulative), +Inf last
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def to_dict(self) -> dict:
        return {"counts": list(self.counts), "sum": self.total}

    def quantile(self, q: float, since: list[int] | None = None) -> float:
        """The q-quantile of the observations (those after `since`, an earlier copy of `counts`),
        interpolated linearly inside its bucket as Prometheus' histogram_quantile does; one in the
        +Inf bucket reads as the largest bound; 0.0 with no observations."""
        counts = self.counts if since is None else [c - s for c, s in zip(self.counts, since)]
        total = sum(counts)
        if total == 0:
            return 0.0
        rank, seen = q * total, 0
        for i, c in enumerate(counts):
            if c and seen + c >= rank:
                if i == len(self.bounds):
                    return self.bounds[-1]
                lo = self.bounds[i - 1] if i else 0.0
                return lo + (self.bounds[i] - lo) * (rank - seen) / c
            seen += c
        return self.bounds[-1]

    def merge(self, d: dict) -> None:
        for i, c in enumerate(d["counts"]):
            self.counts[i] += c
        self.total += d["sum"]
