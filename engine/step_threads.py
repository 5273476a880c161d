"""Threads per model step: a small step leaves one core to the processes that stream its tokens.

When the engine serves over HTTP, every decode step wakes the processes that carry its tokens out
(Ray's and Serve's threads, the ingress, the proxy). On a box whose cores all run OpenMP threads,
each wake-up preempts one of them and the rest wait at the next barrier. A one-row 4-bit step of
SmolLM2 on 2 AVX-512 cores takes 10.9 ms on 2 threads and 15.4 on 1 offline, but over HTTP 20.9
on 2 and 16.6 on 1 (c2 23.2 vs 19.3 ms; from 8 streams on, 2 threads win). vLLM's CPU backend
reserves a core for its front end for the same reason; here only small steps give it up, so a
loaded engine keeps every core.

Off by default since served engines spin ~2 ms before their OpenMP threads sleep and `orbital
serve` has no proxy hop (router/serve_tuning.py, router/direct_ingress.py): most of the 2-thread
loss above was futex wake-ups after a 20 us spin, and every core for every step then won 1.14x at
1 and 4 streams, 1.04x at 8 on a 2-core AVX2 EPYC (`python -m bench.bench_spare_core`).
"""

from __future__ import annotations

import torch


class StepThreads:
    """`full` threads, or `full - 1` for steps of at most `spare_core_max_tokens` tokens."""

    def __init__(self, full: int, spare_core_max_tokens: int) -> None:
        self.full, self.spare_core_max_tokens = full, spare_core_max_tokens
        self.current = full

    def threads_for(self, num_tokens: int) -> int:
        small = self.full > 1 and num_tokens <= self.spare_core_max_tokens
        return self.full - 1 if small else self.full

    def apply(self, num_tokens: int) -> None:
        want = self.threads_for(num_tokens)
        if want != self.current:
            torch.set_num_threads(want)
            self.current = want
