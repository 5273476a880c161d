"""Which attention backend runs where: a backend that cannot run on the model's device is
refused at start (forcing cpu_paged on CUDA used to leave decode rows uninitialised)."""

from __future__ import annotations

import pytest
import torch

from engine.layers.attention.cpu_paged import kernel_available
from engine.layers.attention.selector import get_backend


def test_cpu_paged_refused_off_cpu():
    with pytest.raises(ValueError, match="cpu_paged attention backend runs on CPU only"):
        get_backend("cpu_paged", torch.device("cuda"))


def test_triton_paged_refused_off_cuda():
    with pytest.raises(ValueError, match="triton_paged attention backend runs on CUDA only"):
        get_backend("triton_paged", torch.device("cpu"))


def test_env_forced_cpu_paged_refused_on_cuda(monkeypatch):
    monkeypatch.setenv("ORBITAL_ATTENTION_BACKEND", "cpu_paged")
    with pytest.raises(ValueError, match="CPU only"):
        get_backend(device="cuda")


def test_auto_never_picks_a_cpu_kernel_for_cuda():
    # Without CUDA/Triton here this is the reference; on a GPU machine it is triton_paged.
    assert get_backend("auto", torch.device("cuda")).name in ("reference", "triton_paged")


def test_auto_on_cpu_and_unknown_name():
    assert get_backend("auto", torch.device("cpu")).name == ("cpu_paged" if kernel_available() else "reference")
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("flash", torch.device("cpu"))


def test_cpu_paged_decode_raises_on_non_cpu_tensors():
    if not kernel_available():
        pytest.skip("the C++ CPU ops did not build here")
    backend = get_backend("cpu_paged", torch.device("cpu"))
    from engine.layers.attention.metadata import AttentionMetadata

    q = torch.zeros(1, 2, 8, device="meta")
    meta = AttentionMetadata(block_size=4, slot_mapping=torch.zeros(1, dtype=torch.long), num_decode_tokens=1)
    with pytest.raises(RuntimeError, match="runs on CPU only"):
        backend.decode(q, torch.zeros(2, 1, 2, 4, 8, device="meta"), meta, 1.0, torch.empty_like(q))
