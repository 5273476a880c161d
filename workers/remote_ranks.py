"""How a step reaches ranks 1..tp-1: one actor call per rank, submitted without waiting.

Calls from one caller to a sequential actor run in submission order, so the driver can fire
step k and go straight to running rank 0 itself; the ranks meet in the step's collectives.
The driver never waits for these calls on the happy path: after each step it only reaps the
calls that have already finished (`ray.wait(timeout=0)`), which releases their refs and
raises a failed rank's error. A rank that fails or dies mid-step also breaks rank 0's
collective (its connection closes), so rank 0's step raises and the executor asks `failures`
who it was.
"""
from __future__ import annotations

import time
from collections import deque

import ray


class RemoteRanks:
    def __init__(self, actors: list, max_pending: int = 4):
        self.actors = actors  # actors[i] is rank i + 1
        self.max_pending = max_pending
        self._pending: deque[list] = deque()  # one list of refs per submitted step, oldest first

    def submit(self, inp) -> None:
        self._pending.append([a.execute.remote(inp) for a in self.actors])

    def reap(self, backlog_timeout_s: float) -> None:
        """Release finished steps (raising a failed rank's error); block only when the ranks
        fall more than `max_pending` steps behind (steps with no collective, e.g. empty ones)."""
        while self._pending:
            refs = self._pending[0]
            wait_s = backlog_timeout_s if len(self._pending) > self.max_pending else 0
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
            if len(done) < len(refs):
                if wait_s:
                    raise TimeoutError(f"remote ranks are {len(self._pending)} steps behind after {wait_s:.0f}s")
                return
            ray.get(refs)
            self._pending.popleft()

    def failures(self, wait_s: float) -> tuple[list[int], dict[int, BaseException]]:
        """After a step failed: (ranks whose actor is gone, {rank: error it raised}). Waits up to
        `wait_s` for the in-flight calls to settle; a rank still blocked there (rank 0 failed
        first) is neither."""
        refs = [(r + 1, ref) for step in self._pending for r, ref in enumerate(step)]
        self._pending.clear()
        deadline = time.monotonic() + wait_s
        dead, failed = [], {}
        for rank, ref in refs:
            if rank in dead or rank in failed:
                continue
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                pass
            except ray.exceptions.RayActorError:
                dead.append(rank)
            except Exception as e:
                failed[rank] = e
        for rank, a in enumerate(self.actors, start=1):  # idle ranks: are they alive?
            if rank in dead:
                continue
            try:
                ray.get(a.ping.options(concurrency_group="control").remote(), timeout=2.0)
            except ray.exceptions.GetTimeoutError:
                pass
            except Exception:
                dead.append(rank)
        return sorted(dead), failed

    def kill(self) -> None:
        self._pending.clear()
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
