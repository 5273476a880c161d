"""The prefill half of the KV hand-off: finished requests whose blocks are read out before they
are freed (requests that set `kv_export_first_block`)."""

from __future__ import annotations

from engine.core.kv_cache_manager import KVCacheManager, cdiv
from engine.request import Request


class KVExports:
    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self._pending: list[Request] = []  # finished, blocks still held

    def add(self, req: Request) -> None:
        """A finished request whose blocks stay held until `release`."""
        self._pending.append(req)

    def take(self) -> list[tuple[Request, list[int]]]:
        """The requests added since the last call, with the block ids to read out (from
        `kv_export_first_block` to the last block holding a prompt token). Free each with
        `release` once read."""
        out = []
        bs = self.kv_cache_manager.block_size
        for req in self._pending:
            ids = self.kv_cache_manager.get_block_ids(req.request_id)
            out.append((req, ids[req.kv_export_first_block : cdiv(req.num_prompt_tokens, bs)]))
        self._pending = []
        return out

    def release(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
