"""The step builder's decode buckets: the vectorised split equals the exhaustive dynamic
programme it replaced, and a 256-row decode step is built in milliseconds."""

from __future__ import annotations

import random
import time

from engine.runner.attn_metadata_builder import _BUCKET_OVERHEAD_BLOCKS, _MAX_BUCKETS, _split_buckets, build_step_batch
from tests.engine.paged_cases import make_step


def _split_exhaustive(blocks):
    n, inf = len(blocks), float("inf")
    best = [[inf] * (n + 1) for _ in range(_MAX_BUCKETS + 1)]
    prev = [[0] * (n + 1) for _ in range(_MAX_BUCKETS + 1)]
    best[0][0] = 0
    for k in range(1, _MAX_BUCKETS + 1):
        for j in range(1, n + 1):
            for i in range(j):
                c = best[k - 1][i] + (j - i) * blocks[j - 1] + _BUCKET_OVERHEAD_BLOCKS
                if c < best[k][j]:
                    best[k][j], prev[k][j] = c, i
    k = min(range(1, _MAX_BUCKETS + 1), key=lambda kk: best[kk][n])
    runs, j = [], n
    while k > 0:
        runs.append((prev[k][j], j))
        j, k = prev[k][j], k - 1
    return runs[::-1]


def test_split_equals_exhaustive_search():
    rng = random.Random(0)
    cases = [[1], [3, 3], [1, 2, 3, 4], [5] * 9, [1] * 5 + [200] * 5]
    cases += [sorted(rng.randint(1, rng.choice([4, 60, 400])) for _ in range(rng.randint(1, 70))) for _ in range(60)]
    for blocks in cases:
        assert _split_buckets(blocks) == _split_exhaustive(blocks), blocks


def test_256_row_split_is_fast():
    blocks = sorted(random.Random(2).randint(1, 60) for _ in range(256))
    took = min(_timed(_split_buckets, blocks) for _ in range(3))
    assert took < 0.01, f"{took * 1e3:.1f} ms"  # the exhaustive search took ~17 ms here


def _timed(fn, *args):
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def test_256_row_decode_step_is_built_fast():
    ctx = sorted(random.Random(1).randint(10, 900) for _ in range(256))
    states, counts = make_step(ctx, [], 16, 20000)
    build_step_batch(states, counts, 16, "cpu")  # warm-up (imports, allocator)
    t = time.perf_counter()
    batch = build_step_batch(states, counts, 16, "cpu")
    took = time.perf_counter() - t
    assert batch.meta.num_decode_tokens == 256 and 1 <= len(batch.meta.decode_buckets) <= _MAX_BUCKETS
    assert took < 0.05, f"{took * 1e3:.1f} ms"
