"""Arrival patterns: when each request is sent.

Open loop (``Poisson``, ``Burst``, ``Constant``) gives send times in seconds from the start;
closed loop (``ClosedLoop``) keeps a fixed number of requests in flight.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Poisson:
    """Exponential gaps at ``rate`` requests/s (``inf``: everything at t=0). Seeded."""

    rate: float
    seed: int = 0

    def times(self, n: int) -> list[float]:
        if math.isinf(self.rate):
            return [0.0] * n
        if self.rate <= 0:
            raise ValueError("rate must be > 0")
        rng = random.Random(self.seed)
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(self.rate)
        return out

    def describe(self) -> dict:
        return {"pattern": "poisson", "rate": self.rate, "seed": self.seed}


@dataclass(frozen=True)
class Constant:
    """One request every 1/rate seconds."""

    rate: float

    def times(self, n: int) -> list[float]:
        if self.rate <= 0:
            raise ValueError("rate must be > 0")
        return [i / self.rate for i in range(n)]

    def describe(self) -> dict:
        return {"pattern": "constant", "rate": self.rate}


@dataclass(frozen=True)
class Burst:
    """``size`` requests at once every ``interval`` seconds."""

    size: int
    interval: float

    def times(self, n: int) -> list[float]:
        if self.size < 1 or self.interval < 0:
            raise ValueError("burst size must be >= 1 and interval >= 0")
        return [(i // self.size) * self.interval for i in range(n)]

    def describe(self) -> dict:
        return {"pattern": "burst", "size": self.size, "interval": self.interval}


@dataclass(frozen=True)
class ClosedLoop:
    """``concurrency`` clients, each sending its next request when the previous one ends."""

    concurrency: int

    def __post_init__(self):
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")

    def describe(self) -> dict:
        return {"pattern": "closed", "concurrency": self.concurrency}


Arrival = Poisson | Constant | Burst | ClosedLoop


def load_of(arrival: Arrival) -> float:
    """The offered-load number a sweep plots on its x axis."""
    if isinstance(arrival, ClosedLoop):
        return float(arrival.concurrency)
    if isinstance(arrival, Burst):
        return arrival.size / arrival.interval if arrival.interval else math.inf
    return arrival.rate
