"""Token-granular prefix hits: reuse the leading tokens of a block that is not a full-block hit.

Full-block hashing (block_hash.py) finds a prompt's cached prefix only in whole blocks, and the
last token is always recomputed. So a prompt recomputed up to `block_size` tokens it shares
with a cached one: the rest of a shared system prompt that ends mid-block, the partial last
block of the previous turn of a chat, or a fully cached prompt whose length is a multiple of
the block size (its last block is held back for the logits). llama.cpp's slots and SGLang's
radix tree reuse down to the token; here one more lookup after the full-block chain does.

Candidates are the blocks whose leading tokens are known, by (parent, first token):
  * every full cached block (its tokens are stored beside its hash), and
  * the partial last block of a request that was freed (finished, aborted or preempted): its
    first `num_computed_tokens % block_size` slots hold KV. It stays a candidate while it sits
    in the free queue and is forgotten when the block is popped for reuse.
A hit copies the candidate's first j slots into the request's own next block (copy-on-write:
the candidate may be in use or may be reused later), so the request computes from token j of
that block on. The runner performs the copies before the step's forward (SchedulerOutput.kv_copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.core.free_block_queue import KVCacheBlock

# Candidates compared per lookup (newest first): a bound on the lookup's cost when many blocks
# share a parent and a first token.
MAX_CANDIDATES = 32


@dataclass(frozen=True)
class TailHit:
    """Copy the first `num_tokens` KV slots of `block` into the request's next block."""

    block: KVCacheBlock
    num_tokens: int


def tail_key(parent: int | None, cache_salt: str | None, block_index: int, first_token: int) -> tuple:
    # The parent hash carries the salt down the chain; a chain's first block has only the root.
    return (parent, cache_salt if block_index == 0 else None, first_token)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class TailIndex:
    """Blocks whose leading tokens are known, by tail_key. A block is in it at most once."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, dict[int, KVCacheBlock]] = {}

    def add(self, block: KVCacheBlock, key: tuple, tokens: Sequence[int]) -> None:
        self.drop(block)
        block.tail_key, block.tail_tokens = key, tuple(tokens)
        self._by_key.setdefault(key, {})[block.block_id] = block

    def drop(self, block: KVCacheBlock) -> None:
        key = block.tail_key
        if key is None:
            return
        same = self._by_key.get(key)
        if same is not None:
            same.pop(block.block_id, None)
            if not same:
                del self._by_key[key]
        block.tail_key = block.tail_tokens = None

    def clear(self, blocks: Sequence[KVCacheBlock]) -> None:
        for b in blocks:
            b.tail_key = b.tail_tokens = None
        self._by_key.clear()

    def longest(self, key: tuple, want: Sequence[int], skip: set[int]) -> TailHit | None:
        """The candidate under `key` sharing the most leading tokens with `want` (ids in `skip`
        are not filled yet), or None when none shares any."""
        same = self._by_key.get(key)
        if not same:
            return None
        best: TailHit | None = None
        for n, block in enumerate(reversed(same.values())):
            if n == MAX_CANDIDATES:
                break
            if block.block_id in skip:
                continue
            j = common_prefix(block.tail_tokens, want)
            if best is None or j > best.num_tokens:
                best = TailHit(block, j)
                if j == len(want):
                    break
        return best if best is not None and best.num_tokens > 0 else None

    def check(self, blocks: Sequence[KVCacheBlock]) -> None:
        indexed = {bid for same in self._by_key.values() for bid in same}
        keyed = {b.block_id for b in blocks if b.tail_key is not None}
        assert indexed == keyed, f"tail index {indexed} != keyed blocks {keyed}"
        for key, same in self._by_key.items():
            for bid, block in same.items():
                assert block is blocks[bid] and block.tail_key == key and block.tail_tokens, block
                assert block.tail_tokens[0] == key[2], block
