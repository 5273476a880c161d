"""Stored Responses (`/v1/responses` with `store`), in this router replica's memory only: by id,
each with the conversation that led to it, for a bounded time and count."""

from __future__ import annotations

import time
from collections import OrderedDict

STORE_TTL_S = 3600.0
STORE_MAX = 1024


class ResponseStore:
    """Stored responses by id, each with the conversation that led to it (chat messages, its
    own output last), dropped after `ttl_s` or when more than `max_items` are kept."""

    def __init__(self, max_items: int = STORE_MAX, ttl_s: float = STORE_TTL_S) -> None:
        self.max_items, self.ttl_s = max_items, ttl_s
        self._items: OrderedDict[str, tuple[float, dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._expire()
        self._items[response["id"]] = (time.monotonic() + self.ttl_s, response, conversation)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        self._expire()
        entry = self._items.get(response_id)
        return None if entry is None else (entry[1], entry[2])

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._items.pop(response_id, None) is not None

    def _expire(self) -> None:
        now = time.monotonic()
        while self._items and next(iter(self._items.values()))[0] <= now:
            self._items.popitem(last=False)
