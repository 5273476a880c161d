"""bench/bench_openvino.py without an OpenVINO environment: it says how to set one up and exits 0,
loading no model (a real subprocess, as a user runs it)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.bench_openvino", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_without_openvino_arguments_prints_the_setup_and_exits_0():
    res = _run()
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "missing --ov-model (not given), --ov-python (not given)" in out
    assert "-m venv /tmp/ov-venv" in out
    assert "/tmp/ov-venv/bin/pip install torch==2.13.0 openvino-genai optimum-intel" in out
    assert "optimum-cli export openvino --model " in out
    assert "--weight-format fp16 /tmp/ov-smollm2" in out
    assert "-m bench.bench_openvino --ov-model /tmp/ov-smollm2 --ov-python /tmp/ov-venv/bin/python" in out


def test_paths_that_do_not_exist_count_as_missing(tmp_path):
    res = _run("--ov-model", str(tmp_path / "no-model"), "--ov-python", str(tmp_path / "no-python"))
    assert res.returncode == 0, res.stderr
    assert f"--ov-model {tmp_path / 'no-model'}" in res.stdout
    assert "optimum-cli export openvino" in res.stdout
