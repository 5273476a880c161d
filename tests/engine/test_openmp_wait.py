"""The OpenMP wait default (engine/__init__.py): a bounded spin unless the user chose a policy.
libgomp reads these once, when torch loads it, so each case is a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import os, engine, torch; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"


def probe(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "2000 None"),  # the default: spin ~20 us between parallel regions, then sleep
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "None PASSIVE"),  # the user's policy is left alone
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "None ACTIVE"),
        ({"GOMP_SPINCOUNT": "50"}, "50 None"),
    ],
)
def test_openmp_wait_default(env: dict, expected: str) -> None:
    assert probe(**env) == expected
