"""The choice of attention backend at start-up (`get_backend`)."""

from __future__ import annotations

import os

import torch

from engine.layers.attention.backend import AttentionBackend
from engine.layers.attention.cpu_paged import CpuPagedAttentionBackend
from engine.layers.attention.cpu_paged import kernel_available as cpu_kernel_available
from engine.layers.attention.reference import ReferenceAttentionBackend
from engine.layers.attention.triton_paged import TritonPagedAttentionBackend
from engine.layers.attention.triton_paged import kernel_available as triton_kernel_available

_INSTANCES: dict[str, AttentionBackend] = {}
_NAMES = ("auto", "reference", "cpu_paged", "triton_paged")


def get_backend(name: str | None = None, device: torch.device | str | None = None) -> AttentionBackend:
    """`auto`: on CPU the C++ paged kernel when it builds, on CUDA the Triton paged kernel when
    Triton imports, else the PyTorch reference. `device` defaults to torch's default device (the
    model loader builds layers under `with torch.device(...)`).
    Set ORBITAL_ATTENTION_BACKEND=reference|cpu_paged|triton_paged to force one; a backend that
    cannot run on the model's device is refused here rather than computing garbage later."""
    name = name or os.environ.get("ORBITAL_ATTENTION_BACKEND", "auto")
    device = torch.device(device) if device is not None else torch.get_default_device()
    if name == "torch":
        name = "reference"
    if name not in _NAMES:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(_NAMES)}")
    if name == "auto":
        name = _auto_name(device)
    elif name == "cpu_paged" and device.type != "cpu":
        raise ValueError(
            f"the cpu_paged attention backend runs on CPU only, the model is on {device}; "
            "use auto, triton_paged or reference"
        )
    elif name == "triton_paged" and device.type != "cuda":
        raise ValueError(
            f"the triton_paged attention backend runs on CUDA only, the model is on {device}; "
            "use auto, cpu_paged or reference"
        )
    if name not in _INSTANCES:
        _INSTANCES[name] = _make(name)
    return _INSTANCES[name]


def _auto_name(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu_paged" if cpu_kernel_available() else "reference"
    return "triton_paged" if triton_kernel_available(device) else "reference"


def _make(name: str) -> AttentionBackend:
    if name == "reference":
        return ReferenceAttentionBackend()
    if name == "cpu_paged":
        if not cpu_kernel_available():
            raise RuntimeError("the cpu_paged attention backend could not be built (needs a C++ compiler and ninja)")
        return CpuPagedAttentionBackend()
    if not triton_kernel_available(torch.device("cuda")):
        raise RuntimeError("the triton_paged attention backend needs CUDA and the triton package")
    return TritonPagedAttentionBackend()
