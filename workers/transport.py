"""How the driver hands one step to every rank and gets rank 0's answer back.

Two ways, same interface: plain actor calls (~0.8-1.4 ms round trip here) and a Ray Compiled
Graph (`ray.dag`, ~0.1-0.4 ms: the input goes through shared-memory channels to a loop already
running in each actor). Both surface a dead or failed rank as an exception, never a hang.

Compiled graphs busy-poll their channels: every rank's loop spins while idle (measured ~0.6 of
a core each) and the driver spins while it waits for a step (~1 core). Where cores are spare
(GPU nodes, big CPU hosts) that buys the lowest latency; where the ranks need every core (this
2-core CPU box) it steals them from the model and tp=2 steps got ~3x slower. `default_transport`
picks accordingly; `workers/bench_tp.py` measures both.
"""
from __future__ import annotations

import os
import time

import ray


class ActorCallTransport:
    name = "actor_calls"

    def __init__(self, actors: list, poll_s: float = 0.5):
        self.actors, self.poll_s = actors, poll_s

    def step(self, inp, timeout_s: float):
        refs = [a.execute.remote(inp) for a in self.actors]
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get(refs[0], timeout=self.poll_s)
            except ray.exceptions.GetTimeoutError:
                pass
            # Rank 0 is still busy: it may be waiting in a collective for a rank that failed.
            done, _ = ray.wait(refs[1:], num_returns=len(refs) - 1, timeout=0)
            if done:
                ray.get(done)  # raises the failed rank's error
            if time.monotonic() > deadline:
                raise TimeoutError(f"step did not finish within {timeout_s:.0f}s")

    def close(self) -> None:
        pass


class CompiledGraphTransport:
    name = "compiled_graph"

    def __init__(self, actors: list):
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as inp:
            dag = MultiOutputNode([a.execute.bind(inp) for a in actors])
        self.graph = dag.experimental_compile()

    def step(self, inp, timeout_s: float):
        # Dead actors are noticed by the graph's own monitor, which fails this get early.
        return ray.get(self.graph.execute(inp), timeout=timeout_s)[0]

    def close(self) -> None:
        try:
            self.graph.teardown()
        except Exception:
            pass


def default_transport(device_type: str, tp: int, threads_per_rank: int = 1) -> str:
    """ORBITAL_TP_TRANSPORT if set; else compiled graphs on CUDA or when the spinning readers
    (tp rank loops + the driver) each get a core the ranks' compute does not use."""
    env = os.environ.get("ORBITAL_TP_TRANSPORT")
    if env:
        return env
    if device_type == "cuda":
        return "compiled_graph"
    spare = (os.cpu_count() or 1) - tp * threads_per_rank
    return "compiled_graph" if spare >= tp + 1 else "actor_calls"


def make_transport(kind: str, actors: list):
    if kind == "compiled_graph":
        return CompiledGraphTransport(actors)
    if kind == "actor_calls":
        return ActorCallTransport(actors)
    raise ValueError(f"transport must be 'compiled_graph' or 'actor_calls', got {kind!r}")
