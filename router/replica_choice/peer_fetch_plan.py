"""Whether the replica the ranking chose should fetch the prompt's prefix from the replica holding
more of it (which the load guard passed over) rather than recompute it: a cost model from the
chosen replica's own measurements, as its routing stats publish them (router/replica/
fetch_speed.py, engine/core/prefill_speed.py).

    fetch_s     = latency + extra_blocks * bytes_per_block / bandwidth
    recompute_s = extra_blocks * block_size / prefill_tokens_per_s

Until a replica has measured a figure the defaults below stand in. They are assumptions, not
measurements: a replica replaces the prefill speed after its first prefill step of 64 tokens or
more, and the fetch figures after its first fetch. The prefill default is on the fast side for a
CPU replica (docs/performance.md's offload-tier run recomputed a 1,000-token SmolLM2-135M prompt
in 4.9 s on 2 shared cores), so an unmeasured replica leans towards recomputing.
"""

from __future__ import annotations

from typing import Any

MODES = ("auto", "always", "off")  # AppConfig.kv_peer_fetch: by the cost model, whenever allowed, never
MIN_EXTRA_BLOCKS = 2  # a smaller gain is not worth a round trip to another replica
DEFAULT_FETCH_BYTES_PER_S = 1e9
DEFAULT_FETCH_LATENCY_S = 0.01
DEFAULT_PREFILL_TOKENS_PER_S = 1000.0


def estimates(extra_blocks: int, block_size: int, stats: dict[str, Any]) -> tuple[float, float] | None:
    """(fetch_s, recompute_s) of `extra_blocks` blocks on the replica whose routing stats are
    `stats`; None when it does not say how big a block is (an older replica: no fetch)."""
    bytes_per_block = stats.get("kv_bytes_per_block")
    if not bytes_per_block:
        return None
    bandwidth = stats.get("kv_fetch_bytes_per_s") or DEFAULT_FETCH_BYTES_PER_S
    latency = stats.get("kv_fetch_latency_s")
    latency = DEFAULT_FETCH_LATENCY_S if latency is None else latency
    prefill = stats.get("prefill_tokens_per_s") or DEFAULT_PREFILL_TOKENS_PER_S
    fetch_s = latency + extra_blocks * bytes_per_block / bandwidth
    return fetch_s, extra_blocks * block_size / prefill


def should_fetch(mode: str, extra_blocks: int, block_size: int, stats: dict[str, Any]) -> bool:
    """Fetch `extra_blocks` blocks from the holder to the replica whose routing stats are `stats`?"""
    if mode == "off" or extra_blocks < MIN_EXTRA_BLOCKS:
        return False
    est = estimates(extra_blocks, block_size, stats)
    if est is None:
        return False
    fetch_s, recompute_s = est
    return mode == "always" or fetch_s < recompute_s
