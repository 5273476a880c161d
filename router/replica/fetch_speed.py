"""How fast this replica fetches KV from a peer, measured from its own fetches: the fixed cost
of one fetch (the call to the holder: its wait for a step to end, the read-out, the answer) and
the bandwidth of moving the bytes (out of the object store into this engine). The replica
choice weighs a fetch's estimate against recomputing (router/replica_choice/peer_fetch_plan.py)."""

from __future__ import annotations

WEIGHT = 0.2  # of the newest fetch in the moving averages


class FetchSpeed:
    def __init__(self) -> None:
        self.latency_s: float | None = None  # None: no fetch measured yet
        self.bytes_per_s: float | None = None

    def observe(self, call_s: float, nbytes: int, move_s: float) -> None:
        """One fetch: the call to the holder took `call_s`, moving its `nbytes` took `move_s`."""
        self.latency_s = _average(self.latency_s, call_s)
        if nbytes > 0 and move_s > 0:
            self.bytes_per_s = _average(self.bytes_per_s, nbytes / move_s)


def _average(prev: float | None, sample: float) -> float:
    return sample if prev is None else prev + WEIGHT * (sample - prev)
