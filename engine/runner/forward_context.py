"""Per-batch metadata travels in one context object, not through every forward signature."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from engine.layers.attention.metadata import AttentionMetadata

_CURRENT: Any = None


def get_attn_metadata() -> AttentionMetadata | None:
    return _CURRENT


@contextlib.contextmanager
def forward_context(attn_metadata: AttentionMetadata) -> Iterator[None]:
    global _CURRENT
    prev, _CURRENT = _CURRENT, attn_metadata
    try:
        yield
    finally:
        _CURRENT = prev
