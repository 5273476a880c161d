"""A watch that runs every `every_s` on the ingress's event loop for as long as the ingress
lives: started by the first request (the loop runs by then), idempotently by every later one, and
kept running when one pass fails."""

from __future__ import annotations

import asyncio
import contextvars
import logging

log = logging.getLogger(__name__)


class Periodic:
    every_s: float

    def __init__(self) -> None:
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Idempotent; called with each request."""
        if self._task is None or self._task.done():
            # A fresh context: Serve cancels a request's tasks when the request is cancelled.
            self._task = asyncio.get_running_loop().create_task(self._run(), context=contextvars.Context())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - the watch must outlive one bad pass
                log.exception("%s failed", type(self).__name__)

    async def tick(self) -> None:
        raise NotImplementedError
