"""Cache-aware ranking: the replica that holds the longest cached prefix of the prompt, among the
replicas whose load is within `slack` of the least loaded one (a per-candidate guard: a hot
prefix spreads once its replica runs ahead, and a cache miss never goes to an overloaded
replica). Ties go to the less loaded replica, then to the one holding fewer blocks: a prompt that
hits nowhere lands where the most cache is free, so new prefixes spread over the replicas (as
SGLang's router sends misses to its smallest tree) instead of piling up by chance. Between equal
hits, a replica that holds the request's LoRA adapter (`warm`) goes first: another would read it
from disk and take a slot for it.

Bound: a request never goes to a replica loaded more than `slack` above the least loaded one,
so under a storm of one prefix the loads (in-flight requests, as `least_loaded.replica_load`
counts them) stay within `slack` + 1 of each other.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence, TypeVar

R = TypeVar("R")

DEFAULT_SLACK = 4.0


def rank(
    candidates: Sequence[R],
    load: Callable[[R], float],
    cached: Callable[[R], float],
    slack: float = DEFAULT_SLACK,
    held: Callable[[R], int] = lambda r: 0,
    warm: Callable[[R], bool] = lambda r: False,
) -> tuple[list[R], dict[R, float]]:
    """Candidates best first, and the cached blocks seen for each (a block in an offload tier
    counts as part of one: request_router.TIER_WORTH). `held`: all blocks a replica holds or is
    about to (the tie-break after load); `warm`: it holds the request's adapter."""
    loads = {r: load(r) for r in candidates}
    hits = {r: cached(r) for r in candidates}
    sizes = {r: held(r) for r in candidates}
    warmth = {r: warm(r) for r in candidates}
    floor = min(loads.values())
    tie = {r: random.random() for r in candidates}
    best = max(
        (r for r in candidates if loads[r] <= floor + slack),
        key=lambda r: (hits[r], warmth[r], -loads[r], -sizes[r], tie[r]),
    )
    rest = sorted((r for r in candidates if r is not best), key=lambda r: (loads[r], sizes[r], tie[r]))
    return [best, *rest], hits
