"""Requests this process (an ingress replica) runs on each engine replica."""

from __future__ import annotations

import threading


class LocalLoad:
    """Requests this process runs on each engine replica: +1 when the replica choice picks one
    for a `submit` (then moved if Serve sent it elsewhere, once `submit` answers with the
    replica), -1 when the router ends the request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # Serve's routing loop may run on its own thread
        self._replica_of: dict[str, str] = {}
        self._ended: set[str] = set()  # ended before their routing was reported
        self.counts: dict[str, int] = {}

    def routed(self, request_id: str, replica: str) -> None:
        """Count the request on `replica` (moved there if it was counted elsewhere)."""
        with self._lock:
            if request_id in self._ended:
                self._ended.discard(request_id)
                return
            before = self._replica_of.get(request_id)
            if before == replica:
                return
            if before is not None:
                self.counts[before] -= 1
            self._replica_of[request_id] = replica
            self.counts[replica] = self.counts.get(replica, 0) + 1

    def done(self, request_id: str) -> None:
        with self._lock:
            replica = self._replica_of.pop(request_id, None)
            if replica is None:
                if len(self._ended) > 10_000:  # routing never reported (call failed): forget
                    self._ended.clear()
                self._ended.add(request_id)
            else:
                self.counts[replica] -= 1

    def get(self, replica: str) -> int | None:
        return self.counts.get(replica)
