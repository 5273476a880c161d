"""dtype=auto per CPU kind, and the warning for bfloat16 where the CPU emulates it."""

import logging

import pytest
import torch

from engine import model_config
from engine.model_config import resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize("fast_bf16,want", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_picks_bf16_only_where_the_cpu_has_it(monkeypatch, fast_bf16, want):
    monkeypatch.setattr(model_config, "cpu_has_fast_bf16", lambda: fast_bf16)
    assert resolve_dtype("auto", CPU) == want


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_explicit_bf16_warns_where_it_is_emulated(monkeypatch, caplog, fast_bf16):
    monkeypatch.setattr(model_config, "cpu_has_fast_bf16", lambda: fast_bf16)
    with caplog.at_level(logging.WARNING, logger="engine.model_config"):
        assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
        assert resolve_dtype("float32", CPU) == torch.float32
    warned = [r for r in caplog.records if "emulated" in r.getMessage()]
    assert len(warned) == (0 if fast_bf16 else 1)


def test_this_cpu_answers_from_its_flags():
    flags = open("/proc/cpuinfo").read()
    assert model_config.cpu_has_fast_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)
