"""Engine replicas this process knows to be gone before Serve does.

A SIGKILLed replica stays in the routers' lists for 40-110 s, until Serve's controller notices;
the ingress learns at once (its output channel fails with actor death). For `TTL_S` (by then
Serve has replaced it under a new id), the replica choice leaves it out of every `submit`."""

from __future__ import annotations

import threading
import time

TTL_S = 300.0


class Unreachable:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # Serve's routing loop may run on its own thread
        self._until: dict[str, float] = {}

    def add(self, replica: str) -> None:
        with self._lock:
            self._until[replica] = time.monotonic() + TTL_S

    def current(self) -> frozenset[str]:
        if not self._until:
            return frozenset()
        now = time.monotonic()
        with self._lock:
            for r in [r for r, t in self._until.items() if t <= now]:
                del self._until[r]
            return frozenset(self._until)
