"""The KV cache's memory: zeroed, one independent writable tensor per layer, on any device path."""

from __future__ import annotations

import torch

from engine.runner.kv_memory import allocate_kv_caches


def test_cpu_kv_caches_are_zeroed_and_independent():
    caches, buf = allocate_kv_caches(3, (2, 2, 40, 16, 8), torch.bfloat16, torch.device("cpu"))
    assert buf is not None and len(caches) == 3
    for c in caches:
        assert c.shape == (2, 2, 40, 16, 8) and c.dtype == torch.bfloat16 and c.is_contiguous()
        assert c.abs().sum().item() == 0
    caches[1][1, 0, 5].fill_(2.0)
    assert caches[0].abs().sum().item() == 0 and caches[2].abs().sum().item() == 0
    assert caches[1].sum().item() == 2.0 * 16 * 8


def test_kv_caches_outlive_the_returned_buffer_name():
    caches, buf = allocate_kv_caches(2, (4, 4), torch.float32, torch.device("cpu"))
    del buf  # the tensors keep the mapping alive
    caches[0].add_(1.0)
    assert caches[0].sum().item() == 16 and caches[1].sum().item() == 0
