"""A hint that another engine holds a request's prompt prefix in its prefix cache.

The serving layer sets it when its replica choice sent a request away from the engine holding
its prefix (the load guard): the engine holding blocks for the request asks its caller to fetch
those blocks from `source` instead of recomputing them (awaiting_kv.py). `source` is opaque to
the engine: the caller alone knows what it names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PeerPrefix:
    source: str  # who holds the prefix (the serving layer's replica id)
    num_tokens: int  # leading prompt tokens it holds, in whole blocks
