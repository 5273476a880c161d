"""One tensor-parallel rank: a Ray actor that holds a model shard, its KV cache shard and its
own per-request state (engine.ModelRunner), and runs one step per driver message.

The driver sends a `StepInput` per step: the scheduler's delta plus the token ids rank 0
sampled last step (ranks != 0 do not sample, so this is how they learn them). Rank 0 returns
the ModelRunnerOutput; the other ranks return None.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


@dataclass
class StepInput:
    so: SchedulerOutput
    # request id -> token ids rank 0 sampled in the previous step (applied by ranks != 0).
    prev_sampled: dict[str, list[int]] = field(default_factory=dict)


def sampled_delta(out: ModelRunnerOutput | None) -> dict[str, list[int]]:
    if out is None:
        return {}
    return {r: t for r, t in zip(out.request_ids, out.sampled_token_ids) if t}


class TPWorker:
    """Wrapped with ray.remote by the executor (this module itself does not need ray)."""

    def __init__(self, rank: int, world_size: int, device: str = "cpu", num_threads: int = 1):
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)  # Ray sets CUDA_VISIBLE_DEVICES to our GPU
        self.num_threads = num_threads
        torch.set_num_threads(num_threads)
        self.runner = None
        self._store = None
        self._broken: str | None = None
        self._fail_next = False
        self._rendezvous: tuple[str, int] | None = None
        self._steps, self._busy_s = 0, 0.0  # time inside the model runner (benchmarks)

    # ---- set-up, called once in this order ----
    def open_rendezvous(self) -> tuple[str, int]:
        from workers.process_group import open_rendezvous

        addr, port, self._store = open_rendezvous(self.world_size)
        self._rendezvous = (addr, port)
        return addr, port

    def join(self, addr: str, port: int) -> None:
        from workers.process_group import join_group

        self._rendezvous = (addr, port)
        join_group(self.rank, self.world_size, addr, port, self.device, store=self._store)

    def load(self, model_config, cache_config) -> int:
        """Build this rank's model shard (reads only its slices) and return its KV block budget."""
        from engine.model_runner import ModelRunner

        self.runner = ModelRunner(model_config, cache_config, self.device)
        self.runner.load_model()
        return self.runner.num_blocks_for_budget()

    def init_kv_cache(self, num_blocks: int) -> int:
        self.runner.init_kv_cache(num_blocks)
        return self.runner.bytes_per_block()

    # ---- per step ----
    def execute(self, inp: StepInput) -> ModelRunnerOutput | None:
        if self._broken:
            raise RuntimeError(f"tensor-parallel rank {self.rank} is unusable after an earlier error: {self._broken}")
        if torch.get_num_threads() != self.num_threads:  # compiled graphs run us on their own thread
            torch.set_num_threads(self.num_threads)
        try:
            if self._fail_next:
                self._fail_next = False
                raise RuntimeError("injected fault")
            if self.rank != 0:
                states = self.runner.states
                for rid, toks in inp.prev_sampled.items():
                    st = states.get(rid)
                    if st is not None:
                        st.output_token_ids.extend(toks)
            t0 = time.perf_counter()
            out = self.runner.execute_model(inp.so)
            self._busy_s += time.perf_counter() - t0
            self._steps += 1
            return out
        except BaseException as e:
            self._broken = f"{type(e).__name__}: {e}"
            # Leave the group so peers blocked in a collective with us fail instead of hanging.
            from workers.process_group import leave_group

            leave_group()
            raise RuntimeError(f"tensor-parallel rank {self.rank} failed: {self._broken}") from e

    # ---- health and introspection ----
    def ping(self) -> int:
        return self.rank

    def info(self) -> dict:
        import ray

        from engine.model.loader import parameter_bytes

        kv = self.runner.kv_caches if self.runner else []
        ctx = ray.get_runtime_context()
        return {
            "rank": self.rank, "pid": os.getpid(), "node_id": ctx.get_node_id(),
            "placement_group_id": ctx.get_placement_group_id(), "rendezvous": self._rendezvous,
            "param_bytes": parameter_bytes(self.runner.model) if self.runner and self.runner.model else 0,
            "kv_cache_shape": tuple(kv[0].shape) if kv else None,
            "num_kv_heads": self.runner.num_kv_heads_local if self.runner and self.runner.model else None,
            "num_threads": torch.get_num_threads(), "device": str(self.device),
        }

    def step_stats(self, reset: bool = False) -> tuple[int, float]:
        """(steps, seconds spent in the model runner) since the last reset."""
        stats = (self._steps, self._busy_s)
        if reset:
            self._steps, self._busy_s = 0, 0.0
        return stats

    def fail_next_step(self) -> None:
        """Test hook: the next `execute` raises as if the model had failed on this rank."""
        self._fail_next = True

    def shutdown(self) -> None:
        from workers.process_group import leave_group

        leave_group()
        self.runner = None
