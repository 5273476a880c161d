"""Median wall time of a callable, after one warm-up call (the benchmarks' one timer)."""

from __future__ import annotations

import statistics
import time


def median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
