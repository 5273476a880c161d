"""How the driver hands one step to every rank and gets rank 0's answer back.

Two ways, same interface: plain actor calls (~1 ms round trip here) and a Ray Compiled Graph
(`ray.dag`, ~0.3 ms: the input goes through shared-memory channels to a loop already running
in each actor). `workers/bench_tp.py` measures both; the executor uses the compiled graph by
default. Both surface a dead or failed rank as an exception instead of waiting forever.
"""
from __future__ import annotations

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


def make_transport(kind: str, actors: list):
    if kind == "compiled_graph":
        return CompiledGraphTransport(actors)
    if kind == "actor_calls":
        return ActorCallTransport(actors)
    raise ValueError(f"transport must be 'compiled_graph' or 'actor_calls', got {kind!r}")
