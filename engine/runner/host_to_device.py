"""Host tensors onto the device without waiting for the device.

A copy from pageable host memory to a CUDA device first waits for all work queued on the stream
(CUDA's documented behaviour for pageable transfers), so one `torch.tensor(values, device=cuda)`
after a step's forward makes the host sit idle until that forward ends. Copied from pinned
memory with `non_blocking`, the copy is queued behind the forward instead, and the host goes on.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` (a CPU tensor) on `device`; queued, not waited for, on CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def tensor(values: list | tuple, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, device=device) without the wait."""
    return to_device(torch.tensor(values, dtype=dtype), device)
