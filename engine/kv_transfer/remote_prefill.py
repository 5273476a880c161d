"""The scheduler half of the KV hand-off (decode side): requests waiting for KV computed by a
prefill engine, and the loads the engine asks its caller to perform.

A new request whose uncached prompt is long gets blocks for its whole prompt (hit blocks
included) and waits in WAITING_FOR_REMOTE_KV; its blocks are not published in the prefix cache
until their contents arrive. The caller fetches the KV of `prompt[:-1]` from `first_block` on
(the last prompt token is computed here: that step yields the first token's logits, so sampling,
logprobs and stop checks stay local) and hands it back; then the request is scheduled like one
with `num_computed_tokens` tokens already computed. A failed load either recomputes here or fails
the request (the caller's policy).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_transfer.config import KVTransferConfig
from engine.request import Request


@dataclass(frozen=True)
class KVLoadRequest:
    """Ask a prefill engine for the KV of `prompt_token_ids` (the sequence's prompt minus its
    last token), blocks `first_block` .. `first_block + num_blocks - 1` of its block table."""

    request_id: str  # the decode engine's sequence id
    prompt_token_ids: list[int]
    first_block: int
    num_blocks: int

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


class RemotePrefill:
    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        self.config, self.block_size = config, block_size
        self.waiting: dict[str, tuple[Request, KVLoadRequest]] = {}  # WAITING_FOR_REMOTE_KV
        self._loads: list[KVLoadRequest] = []  # not yet taken by the caller
        self.num_remote = 0  # prefills asked of a prefill engine
        self.num_local = 0  # prefills this (decode) engine did itself: short uncached suffix
        self.num_failed = 0  # loads that failed (recomputed here or failed the request)

    def remote_tokens(self, req: Request, num_hit: int) -> int:
        """How many leading prompt tokens to fetch (0: prefill here). Only a fresh request:
        not one resumed from another replica, preempted, or wanting prompt logprobs."""
        if (
            self.config.role != "decode"
            or req.num_output_tokens
            or req.num_preemptions
            or req.remote_prefill_tried
            or req.sampling_params.prompt_logprobs is not None
        ):
            return 0
        need = req.num_prompt_tokens - 1  # the last prompt token is computed here
        if need - num_hit <= self.config.local_prefill_max_tokens:
            self.num_local += 1
            return 0
        return need

    def add(self, req: Request, block_ids: list[int], num_hit: int, num_tokens: int) -> None:
        first = num_hit // self.block_size
        load = KVLoadRequest(req.request_id, list(req.prompt_token_ids[:num_tokens]), first, len(block_ids) - first)
        req.remote_prefill_tried = True
        self.waiting[req.request_id] = (req, load)
        self._loads.append(load)
        self.num_remote += 1

    def take_loads(self) -> list[KVLoadRequest]:
        loads, self._loads = self._loads, []
        return loads

    def forget(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)
        self._loads = [x for x in self._loads if x.request_id != request_id]
