"""Whether another Python thread runs while a call is inside C++: a spinner thread stamps the time
(at most every 0.1 ms) and the stamps that fall in the middle half of the calls are counted. A
call that holds the GIL leaves none there (the spinner needs the GIL for each stamp); a call that
drops it leaves some, since the spinner gets CPU time while the call runs."""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable


class Spinner:
    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.calls: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        last = 0.0
        while not self._stop.is_set():
            now = time.perf_counter()
            if now - last > 1e-4:
                self.stamps.append(now)
                last = now

    def __enter__(self) -> "Spinner":
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)  # a thread waiting for the GIL gets it soon after a drop
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)

    def timed(self, call: Callable):
        """Run `call()` and remember its interval."""
        t0 = time.perf_counter()
        out = call()
        self.calls.append((t0, time.perf_counter()))
        return out

    def stamps_inside(self, min_seconds: float = 0.004) -> int:
        """Spinner stamps in the middle half of the calls that took at least `min_seconds`."""
        n = 0
        for t0, t1 in self.calls:
            if t1 - t0 >= min_seconds:
                q = (t1 - t0) / 4
                n += sum(1 for s in self.stamps if t0 + q < s < t1 - q)
        return n
