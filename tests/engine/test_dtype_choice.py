"""dtype=auto per CPU kind, and the warning for bfloat16 where the CPU emulates it and no op of ours
runs it instead."""

import logging

import pytest
import torch

from engine import model_config
from engine.model_config import resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "fast_bf16,op,quantization,want",
    [
        (True, False, None, torch.bfloat16),
        (True, True, "int4", torch.bfloat16),
        (False, True, None, torch.bfloat16),  # AVX2: bf16 weights through the few-row op
        (False, True, "gguf", torch.float32),  # quantized weights keep float32 activations there
        (False, False, None, torch.float32),  # no op: bf16 would be emulated
    ],
)
def test_auto_picks_bf16_where_it_is_fast(monkeypatch, fast_bf16, op, quantization, want):
    monkeypatch.setattr(model_config, "cpu_has_fast_bf16", lambda: fast_bf16)
    monkeypatch.setattr(model_config, "bf16_op_runs", lambda: op)
    assert resolve_dtype("auto", CPU, quantization) == want


@pytest.mark.parametrize("fast_bf16,op", [(True, False), (False, True), (False, False)])
def test_explicit_bf16_warns_where_it_is_emulated(monkeypatch, caplog, fast_bf16, op):
    monkeypatch.setattr(model_config, "cpu_has_fast_bf16", lambda: fast_bf16)
    monkeypatch.setattr(model_config, "bf16_op_runs", lambda: op)
    with caplog.at_level(logging.WARNING, logger="engine.model_config"):
        assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
        assert resolve_dtype("float32", CPU) == torch.float32
    warned = [r for r in caplog.records if "emulated" in r.getMessage()]
    assert len(warned) == (0 if fast_bf16 or op else 1)


def test_the_op_answer_follows_the_switch(monkeypatch):
    monkeypatch.setenv("ORBITAL_SMALL_LINEAR", "0")
    assert not model_config.bf16_op_runs()  # the op off: bf16 GEMMs would be emulated (or native)


def test_this_cpu_answers_from_its_flags():
    flags = open("/proc/cpuinfo").read()
    assert model_config.cpu_has_fast_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)
