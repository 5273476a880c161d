"""KV-cache hand-off between engines (disaggregated prefill and decode; fetches from a peer).

The engine side of it, with no transport: which requests wait for KV computed elsewhere or
cached by a peer (`awaiting_kv.py`, hinted by `peer_prefix.py`) and which finished ones have
theirs read out (`exports.py`), the scheduler halves; a peer's cached blocks read out for
another engine (`cached_export.py`); the block contents read out of and written into the paged
cache (`block_io.py`, the runner half), and the payload with its layout (`blocks.py`).
Moving the payload between processes is the caller's business (router/replica/kv_transport.py).
"""

from engine.kv_transfer.awaiting_kv import KVLoadRequest
from engine.kv_transfer.blocks import KVBlocks, KVLayout
from engine.kv_transfer.config import KVTransferConfig

__all__ = ["KVBlocks", "KVLayout", "KVLoadRequest", "KVTransferConfig"]
