"""KV-cache hand-off between engines (disaggregated prefill and decode; fetches from a peer).

The engine side of it, with no transport: which requests wait for KV computed elsewhere or
cached by a peer (`awaiting_kv.py`, hinted by `peer_prefix.py`) and which finished ones have
theirs read out (`exports.py`), the scheduler halves; a peer's cached blocks read out for
another engine (`cached_export.py`); the block contents read out of and written into the paged
cache (`block_io.py`, the runner half), and the payload with its layout (`blocks.py`).
Moving the payload between processes is the caller's business (router/replica/kv_transport.py).
Import the modules themselves: the router reads `peer_prefix` without the torch the others load.
"""
