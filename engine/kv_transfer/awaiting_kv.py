"""The scheduler half of the KV hand-off (decode side): requests waiting for KV computed by a
prefill engine, and the loads the engine asks its caller to perform.

A new request whose uncached prompt is long gets blocks for its whole prompt (hit blocks
included) and waits in WAITING_FOR_REMOTE_KV; its blocks are not published in the prefix cache
until their contents arrive. The caller fetches the KV of `prompt[:-1]` from `first_block` on
(the last prompt token is computed here: that step yields the first token's logits, so sampling,
logprobs and stop checks stay local) and hands it back; then the request is scheduled like one
with `num_computed_tokens` tokens already computed. A failed load either recomputes here or fails
the request (the caller's policy).

A fetch from a peer (any engine, colocated ones too) takes the same path: a fresh request whose
`peer_prefix` hint says another engine holds more of its prompt than this one's prefix cache
holds blocks for the hinted tokens and waits while the caller copies them from that engine's
prefix cache (`KVLoadRequest.source`); a failed fetch always recomputes here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.kv_transfer.config import KVTransferConfig
from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.core.free_block_queue import KVCacheBlock
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.lora.request import LoRARequest


@dataclass(frozen=True)
class KVLoadRequest:
    """Ask a prefill engine for the KV of `prompt_token_ids` (the sequence's prompt minus its
    last token), blocks `first_block` .. `first_block + num_blocks - 1` of its block table."""

    request_id: str  # the decode engine's sequence id
    prompt_token_ids: list[int]
    first_block: int
    num_blocks: int
    lora_request: LoRARequest | None = None  # the prefill runs with the sequence's adapter
    # A fetch from a peer's prefix cache (PeerPrefix.source, opaque here); None: a remote prefill.
    source: str | None = None
    cache_salt: str | None = None  # the sequence's: a peer looks its blocks up under it

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


class RemotePrefill:
    """`config` None: a colocated engine (no remote prefills; fetches from peers only)."""

    def __init__(self, config: KVTransferConfig | None, kv_cache_manager: KVCacheManager) -> None:
        self.config, self.kv_cache_manager = config, kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.waiting: dict[str, tuple[Request, KVLoadRequest]] = {}  # WAITING_FOR_REMOTE_KV
        self._loads: list[KVLoadRequest] = []  # not yet taken by the caller
        self.num_remote = 0  # prefills asked of a prefill engine
        self.num_local = 0  # prefills this (decode) engine did itself: short uncached suffix
        self.num_failed = 0  # loads that failed (recomputed here or failed the request)
        self.num_peer = 0  # fetches asked of a peer
        self.num_peer_failed = 0  # of which failed (recomputed here)

    def remote_tokens(self, req: Request, num_hit: int) -> int:
        """How many leading prompt tokens to fetch (0: prefill here). Only a fresh request:
        not one resumed from another replica, preempted, or reading every prompt position. (One
        whose remote prefill already ended holds its blocks; the scheduler does not ask.)"""
        if (
            self.config is None
            or self.config.role != "decode"
            or req.num_output_tokens
            or req.num_preemptions
            or req.sampling_params.needs_every_prompt_position
        ):
            return 0
        need = req.num_prompt_tokens - 1  # the last prompt token is computed here
        if need - num_hit <= self.config.local_prefill_max_tokens:
            self.num_local += 1
            return 0
        return need

    def peer_tokens(self, req: Request, num_local: int) -> int:
        """How many leading prompt tokens to fetch from the peer its hint names (0: none), when
        this engine has `num_local` of them (pool and offload tier). Whole blocks, never the last
        prompt token, at least one block more than here; a fresh request only, as `remote_tokens`."""
        hint = req.peer_prefix
        if (
            hint is None
            or req.num_output_tokens
            or req.num_preemptions
            or req.sampling_params.needs_every_prompt_position
            or not self.kv_cache_manager.can_share(req)
        ):
            return 0
        bs = self.block_size
        n = min(hint.num_tokens, req.num_prompt_tokens - 1) // bs * bs
        return n if n - num_local >= bs else 0

    def fetching(self, req: Request, num_local: int) -> bool:
        """A peer fetch in flight for another request brings the block this one would fetch
        first (the block after its `num_local` tokens): fetching it twice costs the pool and the
        peer twice, so the request waits and hits it once it is published. Hashes chain their
        parents, so one equal hash means an equal prefix."""
        i = num_local // self.block_size
        if i >= len(req.block_hashes):
            return False
        h = req.block_hashes[i]
        return any(
            load.source is not None
            and load.first_block <= i < load.first_block + load.num_blocks
            and i < len(other.block_hashes)
            and other.block_hashes[i] == h
            for other, load in self.waiting.values()
        )

    def hold(
        self, req: Request, hit_blocks: list[KVCacheBlock], num_hit: int, num_tokens: int, source: str | None = None
    ) -> bool:
        """Hold blocks for the first `num_tokens` prompt tokens (the `num_hit` of them in
        `hit_blocks` are here already) and wait for the KV of the rest. `source`: fetched from
        that peer's prefix cache (else a remote prefill). False: the pool is short, nothing
        changed."""
        if self.kv_cache_manager.allocate_slots(req, num_tokens - num_hit, hit_blocks, publish=False) is None:
            return False
        req.num_computed_tokens = num_hit
        req.num_cached_tokens = num_hit
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        block_ids = self.kv_cache_manager.get_block_ids(req.request_id)
        first = num_hit // self.block_size
        load = KVLoadRequest(
            req.request_id,
            list(req.prompt_token_ids[:num_tokens]),
            first,
            len(block_ids) - first,
            req.lora_request,
            source,
            req.cache_salt,
        )
        self.waiting[req.request_id] = (req, load)
        self._loads.append(load)
        if source is None:
            self.num_remote += 1
        else:
            self.num_peer += 1
        return True

    def take_loads(self) -> list[KVLoadRequest]:
        loads, self._loads = self._loads, []
        return loads

    def target(self, request_id: str) -> list[int] | None:
        """The block ids a load's contents go to; None when the request is gone (aborted)."""
        entry = self.waiting.get(request_id)
        if entry is None:
            return None
        _, load = entry
        return self.kv_cache_manager.get_block_ids(request_id)[load.first_block : load.first_block + load.num_blocks]

    def finish(self, request_id: str, loaded: bool) -> Request | None:
        """A load ended; the request stops waiting for it and is returned (None when it is gone).
        `loaded`: its contents are in the blocks, which are published in the prefix cache; else
        they are to be recomputed (or the request failed: the caller decides). Either way the
        request keeps its blocks."""
        entry = self.waiting.pop(request_id, None)
        if entry is None:
            return None
        req, load = entry
        if loaded:
            req.num_computed_tokens = load.num_tokens
            if load.source is not None:  # not computed for this request: cached in the cluster
                req.num_cached_tokens = load.num_tokens
            self.kv_cache_manager.publish_blocks(req, load.num_tokens)
        elif load.source is not None:
            self.num_peer_failed += 1
        else:
            self.num_failed += 1
        return req

    def forget(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)
        self._loads = [x for x in self._loads if x.request_id != request_id]
