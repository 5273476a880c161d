"""KV pool size on CUDA from the memory that is actually free after weights and one step.

The pool gets `utilization` of the GPU's memory, minus what is already used (weights, the CUDA
context, other processes: read from the driver after the allocator's cache is released) and
minus the transient peak of a profiled dummy step at the scheduler's token budget, which every
later step may need again on top of the pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.runner.model_runner import ModelRunner


def kv_budget_from_free_memory(runner: ModelRunner, utilization: float, num_tokens: int) -> int:
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    runner.profile_run(num_tokens)
    torch.cuda.synchronize(device)
    step_peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * utilization) - (total - free) - step_peak
    if budget <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: {utilization:.0%} of {total / 2**30:.1f} GiB minus "
            f"{(total - free) / 2**30:.2f} GiB in use and a {step_peak / 2**30:.2f} GiB step peak; "
            "raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return budget
