"""Prefix-cache block hashes: hash(parent hash, block token ids, extra keys).

The hash is the full 256-bit SHA-256 digest as a Python int: collision-safe, so a hit needs no
token comparison, and stable across processes and machines (unlike `hash()`), so the router can
compute the very hashes the engines cache under.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

from engine.request import Request

_NONE_PARENT = b"\x00" * 32


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    """Hash of one full block. Chaining the parent makes the hash identify the whole prefix."""
    h = hashlib.sha256()
    h.update(_NONE_PARENT if parent_hash is None else parent_hash.to_bytes(32, "big"))
    # Length prefixes keep the encoding unambiguous (no token/extra-key boundary confusion).
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    extra = repr(tuple(extra_keys)).encode()
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    return int.from_bytes(h.digest(), "big")


def block_extra_keys(cache_salt: str | None, block_index: int) -> tuple:
    # The salt goes into the first block only; the parent chain carries it to every later one.
    if block_index == 0 and cache_salt is not None:
        return ("salt", cache_salt)
    return ()


def kv_hash_root(kv_cache_dtype: str) -> int | None:
    """The parent of a chain's first block: None for a cache in the model's dtype (the hashes
    stay what they were), else a digest of the KV dtype, so blocks of an int8 cache never match
    a float cache's (an index that spans replicas of both never predicts such a hit)."""
    if kv_cache_dtype == "auto":
        return None
    return int.from_bytes(hashlib.sha256(f"kv_cache_dtype={kv_cache_dtype}".encode()).digest(), "big")


def extend_block_hashes(
    hashes: list[int], tokens: Sequence[int], block_size: int, cache_salt: str | None = None, root: int | None = None
) -> list[int]:
    """Extend `hashes` (those of the leading full blocks of `tokens`) to every full block;
    `root`: the first block's parent (kv_hash_root)."""
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), len(tokens) // block_size):
        block_tokens = tokens[i * block_size : (i + 1) * block_size]
        parent = hash_block_tokens(parent, block_tokens, block_extra_keys(cache_salt, i))
        hashes.append(parent)
    return hashes


def max_hit_blocks(num_tokens: int, block_size: int) -> int:
    """Leading blocks a prompt of `num_tokens` may take from the cache: never its last token,
    which must be recomputed to produce logits."""
    return max(0, num_tokens - 1) // block_size


def prompt_hit_hashes(
    prompt_token_ids: Sequence[int], block_size: int, cache_salt: str | None = None, root: int | None = None
) -> list[int]:
    """The hashes a prefix-cache lookup of this prompt walks, in order (the router predicts a
    replica's hit with them)."""
    n = max_hit_blocks(len(prompt_token_ids), block_size)
    return extend_block_hashes([], prompt_token_ids[: n * block_size], block_size, cache_salt, root)


def update_block_hashes(request: Request, block_size: int, root: int | None = None) -> list[int]:
    """Extend `request.block_hashes` to cover every full block of `all_token_ids`.

    Incremental: only blocks that became full since the last call are hashed.
    """
    return extend_block_hashes(request.block_hashes, request.all_token_ids, block_size, request.cache_salt, root)
