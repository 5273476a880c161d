"""This engine's prefill speed, measured from its own steps: prompt tokens per second of steps
that ran mostly prefill chunks, as a moving average. A serving layer weighs fetching a prompt's
KV from elsewhere against computing it here with it."""

from __future__ import annotations

from typing import Iterable

MIN_TOKENS = 64  # a step with fewer prefill tokens is mostly fixed cost: not a speed sample
WEIGHT = 0.2  # of the newest sample in the average
DECODE_ROW_MAX = 8  # a row of at most this many tokens is a decode row (1 + speculative drafts)


class PrefillSpeed:
    def __init__(self) -> None:
        self.tokens_per_s: float | None = None  # None: no prefill step measured yet

    def observe(self, scheduled: Iterable[int], seconds: float) -> None:
        """One step: the tokens it scheduled per request (a decode row schedules 1, or 1 +
        drafts), and its wall time. The decode rows' time is counted as prefill time: the
        estimate errs on the slow side, which favours fetching."""
        tokens = sum(n for n in scheduled if n > DECODE_ROW_MAX)
        if tokens < MIN_TOKENS or seconds <= 0:
            return
        speed = tokens / seconds
        prev = self.tokens_per_s
        self.tokens_per_s = speed if prev is None else prev + WEIGHT * (speed - prev)
