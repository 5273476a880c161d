"""Fixtures of the engine tests: the C++ CPU ops module, for the kernel tests."""

import pytest

from engine.kernels.cpu_ops import load_cpu_ops


@pytest.fixture(scope="module")
def ops():
    mod = load_cpu_ops()
    assert mod is not None, "the C++ CPU ops did not build"
    return mod
