"""How a step reaches ranks 1..tp-1: one actor call per rank, submitted without waiting.

Calls from one caller to a sequential actor run in submission order, so the driver can fire
step k and go straight to running rank 0 itself; the ranks meet in the step's collectives.
The driver never waits for these calls on the happy path: every few steps it reaps the calls
that have already finished (one `ray.wait(timeout=0)` over them), which releases their refs and
raises a failed rank's error. The step is pickled once for all ranks (plain bytes are Ray's
cheapest argument). A rank that fails or dies mid-step also breaks rank 0's
collective (its connection closes), so rank 0's step raises and the executor asks `failures`
who it was.
"""

from __future__ import annotations

import pickle
import time
from collections import deque

import ray

from workers.messages import StepInput


class RemoteRanks:
    def __init__(self, actors: list, reap_every: int = 4, max_pending: int = 16) -> None:
        self.actors = actors  # actors[i] is rank i + 1
        self.reap_every, self.max_pending = reap_every, max_pending
        self._pending: deque[list] = deque()  # one list of refs per submitted step, oldest first

    def submit(self, inp: StepInput, sampler: int | None = None) -> list:
        """Send the step to every remote rank; rank `sampler` (pp > 1: it sampled the previous
        tokens itself) gets it without them. Returns the calls' refs, rank 1 first."""
        payload = pickle.dumps(inp, protocol=pickle.HIGHEST_PROTOCOL)
        own = payload
        if sampler is not None and inp.prev_sampled:
            own = pickle.dumps(StepInput(inp.so), protocol=pickle.HIGHEST_PROTOCOL)
        refs = [a.execute.remote(own if r == sampler else payload) for r, a in enumerate(self.actors, start=1)]
        self._pending.append(refs)
        return refs

    def reap(self, backlog_timeout_s: float) -> None:
        """Every `reap_every` steps, release the finished earlier steps (raising a failed rank's
        error). Blocks only when the ranks fall `max_pending` steps behind (they can only on
        steps with no collective, e.g. empty ones)."""
        if len(self._pending) <= self.reap_every:
            return
        older = [ref for step in list(self._pending)[:-1] for ref in step]
        done = set(ray.wait(older, num_returns=len(older), timeout=0)[0])
        n = 0
        while n < len(self._pending) and all(r in done for r in self._pending[n]):
            n += 1
        ray.get([r for k in range(n) for r in self._pending[k]])  # a failed rank's error: refs kept for `failures`
        for _ in range(n):
            self._pending.popleft()
        if len(self._pending) > self.max_pending:
            oldest = self._pending[0]
            ready, _ = ray.wait(oldest, num_returns=len(oldest), timeout=backlog_timeout_s)
            if len(ready) < len(oldest):
                raise TimeoutError(f"remote ranks are {len(self._pending)} steps behind after {backlog_timeout_s:.0f}s")
            ray.get(self._pending.popleft())

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
