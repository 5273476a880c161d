"""One request running on an engine replica (`Job`): what the replica's pump, `finish`, `abort`
and lease expiry need to find and end it, and the times its latency histograms are taken from.
"""

from __future__ import annotations

import asyncio
import time

import router.tracing as tracing
from router.replica.outbox import Outbox


class Job:
    """One request running here: its ingress's outbox, its pump task, times for the metrics."""

    __slots__ = (
        "request_id",
        "children",
        "ingress_id",
        "box",
        "task",
        "arrival_wall",
        "arrival_mono",
        "first_token",
        "last_token",
        "children_done",
        "stopped",
        "trace",
    )

    def __init__(self, request_id: str, children: list[str], arrival_wall: float, ingress_id: str, box: Outbox) -> None:
        self.request_id, self.ingress_id, self.box = request_id, ingress_id, box
        self.task: asyncio.Task | None = None
        self.children = children
        self.arrival_wall, self.arrival_mono = arrival_wall, time.monotonic()
        self.first_token: float | None = None
        self.last_token: dict[str, float] = {}
        self.children_done: set[str] = set()
        self.stopped: set[str] = set()  # children the ingress finished (stop string)
        self.trace: tracing.EngineRequestTrace | None = None  # its span (router/tracing.py), when traced
