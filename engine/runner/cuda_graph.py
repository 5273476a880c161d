"""CUDA graphs of the decode forward at bucketed batch sizes.

A small decode step launches ~1,000 kernels whose launch cost on the host is over ten times
their GPU time; a graph replays them all in one launch. One graph per bucket is captured at
start-up, after the KV pool is allocated (its addresses are baked into the graphs). A step
whose rows are all single tokens and fit a bucket fills the static inputs (padding rows up to
the bucket) and replays; any other step runs eagerly.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from engine.runner.decode_inputs import DecodeInputs
from engine.runner.forward_context import forward_context
from engine.runner.runner_state import RunnerRequestState

if TYPE_CHECKING:
    from engine.model.llama import LlamaForCausalLM

MAX_GRAPH_BATCH = 256


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, then every 32: padding stays under a third past 8 rows, and a
    bucket more costs one capture at start-up."""
    small = [b for b in (1, 2, 4, 8, 16, 32) if b < max_batch]
    return small + list(range(64, max_batch, 32)) + [max_batch]


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, inputs: DecodeInputs, max_batch: int) -> None:
        self.model, self.inputs = model, inputs
        self.buckets = graph_buckets(max_batch)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays: dict[int, int] = {}  # bucket -> steps it served (tests check which graphs ran)

    def fits(self, counts: list[int]) -> bool:
        return len(counts) <= self.buckets[-1] and all(n == 1 for n in counts)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()  # one memory pool: only one graph runs at a time
        self.inputs.fill([], self.buckets[-1])  # all padding: capture-time writes go to the spare block
        for b in reversed(self.buckets):  # largest first, so smaller ones reuse its pool memory
            with forward_context(self.inputs.meta(b)):
                self.model(self.inputs.ids[:b], self.inputs.pos[:b])  # Triton compiles, cuBLAS picks, outside capture
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self.model(self.inputs.ids[:b], self.inputs.pos[:b])
            self.graphs[b] = (g, out)
        torch.cuda.synchronize()

    def run(self, states: list[RunnerRequestState]) -> torch.Tensor:
        """Hidden states of the step's rows (a view of the graph's output: read it before the
        next replay)."""
        n = len(states)
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        self.inputs.fill(states, b)
        g, out = self.graphs[b]
        g.replay()
        self.replays[b] = self.replays.get(b, 0) + 1
        return out[:n]
