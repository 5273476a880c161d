"""Bounded queues: past the bound a request is refused at once (HTTP 429 + Retry-After) instead
of waiting, so accepted requests keep their latency.

Two bounds, both counting *queued* requests (accepted, no token produced yet):
  * per engine replica (`ReplicaQueue`, checked inside the replica before the engine sees it);
  * per router replica (`IngressQueue`, checked before tokenizing and routing).
Requests that are already generating do not count: the engine's batch size limits those.
"""

from __future__ import annotations

import math
import time
from collections import deque

from engine.errors import OrbitalError


class OverloadedError(OrbitalError):
    """Too many queued requests; the client should retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def __reduce__(self):  # survive the trip from an engine replica to the router
        return (OverloadedError, (str(self), self.retry_after))


class _Queue:
    def __init__(self, max_queued: int, what: str) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self.max_queued, self.what = max_queued, what
        self.queued: dict[str, float] = {}  # accepted, no output yet -> time.monotonic() admitted
        self.in_flight = 0
        self.rejected = 0
        self._starts: deque[float] = deque(maxlen=64)  # when recent requests left the queue

    def check_room(self, num_requests: int = 1) -> None:
        """OverloadedError unless `num_requests` more fit now (before the work that precedes
        `admit`, e.g. tokenizing: a full queue refuses without it)."""
        if len(self.queued) + num_requests > self.max_queued:
            self.rejected += 1
            raise OverloadedError(
                f"{self.what} has {len(self.queued)} queued requests (limit {self.max_queued}); retry later",
                self.retry_after(),
            )

    def admit(self, request_id: str) -> None:
        self.check_room()
        self.queued[request_id] = time.monotonic()
        self.in_flight += 1

    def started(self, request_id: str) -> None:
        """The request produced its first output: it no longer waits."""
        if self.queued.pop(request_id, None) is not None:
            self._starts.append(time.monotonic())

    def done(self, request_id: str) -> None:
        self.queued.pop(request_id, None)
        self.in_flight -= 1

    def retry_after(self) -> int:
        """Seconds the requests queued now need to leave the queue at its recent drain rate
        (requests starting per second): a retry then finds room without all retrying at once.
        Before two have started, the oldest queued request's wait so far. 1..60."""
        now = time.monotonic()
        recent = [t for t in self._starts if now - t < 60.0]
        if len(recent) >= 2 and recent[-1] > recent[0]:
            rate = (len(recent) - 1) / (recent[-1] - recent[0])
            estimate = len(self.queued) / rate
        else:
            estimate = now - min(self.queued.values()) if self.queued else 1.0
        return max(1, min(60, math.ceil(estimate)))

    def stats(self) -> dict:
        return {"queued": len(self.queued), "in_flight": self.in_flight, "rejected": self.rejected}


class IngressQueue(_Queue):
    def __init__(self, max_queued: int) -> None:
        super().__init__(max_queued, "the router")


class ReplicaQueue(_Queue):
    def __init__(self, max_queued: int) -> None:
        super().__init__(max_queued, "the engine replica")
