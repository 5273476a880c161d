"""Host-side work per engine step outside the model: the stats snapshot the step thread publishes,
and `packed_gemm.linear`'s dispatch around a few-row linear (against calling the op directly).

    python -m bench.bench_step_overhead

Snapshot: `Scheduler.snapshot()` with 1 request running, and with 128 running + 512 waiting
(the scheduler state a loaded replica has). Dispatch: a 64x64 linear at one row, so the time is
the call path, not the arithmetic; both through `linear` and straight into the C++ op.
Medians of `--reps` calls, in microseconds.
"""

from __future__ import annotations

import argparse

import torch

from bench.timing import median_time
from engine.config import CacheConfig, SchedulerConfig
from engine.core.scheduler import Scheduler
from engine.layers.packed_gemm import linear, pack_weight, packing_enabled, small_linear_ops
from engine.request import Request
from engine.sampling_params import SamplingParams


def loaded_scheduler(num_requests: int) -> Scheduler:
    s = Scheduler(
        SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=1 << 16, max_model_len=4096),
        CacheConfig(block_size=16),
        4096,
    )
    for i in range(num_requests):
        s.add_request(Request(f"r{i}", list(range(1, 40)), SamplingParams(max_tokens=50), max_tokens=50))
    s.schedule()
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_step_overhead", description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=2000)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    for n in (1, 640):
        s = loaded_scheduler(n)
        us = median_time(s.snapshot, a.reps) * 1e6
        print(f"snapshot: {len(s.running):4d} running {len(s.waiting):4d} waiting  {us:8.1f} us")
    w, x = torch.randn(64, 64), torch.randn(1, 64)
    ops, y = small_linear_ops(), torch.empty(1, 64)
    weights = [("plain", w)] + ([("packed", pack_weight(w))] if packing_enabled(w.dtype, w.device) else [])
    for name, weight in weights:
        us = median_time(lambda: linear(x, weight), a.reps) * 1e6
        print(f"linear(1x64, {name} weight)                 {us:8.1f} us")
    if ops is not None:
        us = median_time(lambda: ops.small_linear(x, w, None, y), a.reps) * 1e6
        print(f"small_linear op called directly             {us:8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
