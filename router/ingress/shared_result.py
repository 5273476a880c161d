"""One result for every caller within a short window: unauthenticated routes (/health,
/metrics) fan out one call per engine replica, so a client polling them in a loop would
multiply that load at will. Callers within `ttl_s` of a result, and callers while one is being
computed, share it."""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Generic, TypeVar

T = TypeVar("T")


class SharedResult(Generic[T]):
    def __init__(self, compute: Callable[[], Awaitable[T]], ttl_s: float = 1.0) -> None:
        self.compute, self.ttl_s = compute, ttl_s
        self._value: T | None = None
        self._at = float("-inf")
        self._running: asyncio.Future | None = None

    async def get(self) -> T:
        if time.monotonic() - self._at < self.ttl_s:
            return self._value  # type: ignore[return-value]
        if self._running is None:
            self._running = asyncio.ensure_future(self._refresh())
        return await asyncio.shield(self._running)

    async def _refresh(self) -> T:
        try:
            self._value = await self.compute()
            self._at = time.monotonic()
            return self._value
        finally:
            self._running = None
