"""The C++ ops' build targets: chosen from the CPU's flags, keyed per target, and the lower
targets this CPU can run pass the kernel tests too (an AVX-512 BF16 or AMX CI machine also
checks the AVX-512 and AVX2 builds, an AVX-512 one the AVX2 build, an AVX2 one the generic
build), each in its own process. `make test` builds them up front (`python -m
engine.kernels.cpu_ops --lower`), as it builds the best one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kernels import cpu_ops
from engine.kernels.cpu_ops import TARGETS, build_target, load_cpu_ops, lower_test_targets, supported_targets

LOWER = lower_test_targets()
KERNEL_TESTS = [
    "tests/engine/test_attention_backends.py",
    "tests/engine/test_kv_int8_kernels.py",
    "tests/engine/test_fused_elementwise.py",
    "tests/engine/test_small_linear.py",
    "tests/engine/test_int4_small_linear.py",
    "tests/engine/test_int4_five_bits.py",
    "tests/engine/test_int4_int8_dot.py",
    "tests/engine/test_int4_dequantize.py",
    "tests/engine/test_lora_bgmv.py",
    "tests/engine/test_sampler.py",
]


def test_targets_follow_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(cpu_ops.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: {"avx2", "fma", "f16c", "sse4_2"})
    assert supported_targets() == ["avx2", "generic"]
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: set(TARGETS["avx512_bf16"][1]))
    assert supported_targets() == ["avx512_bf16", "avx512", "avx2", "generic"]
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: {"sse2"})
    assert supported_targets() == ["generic"]


# /proc/cpuinfo flags of the three x86 CI kinds (vector extensions only) and what each runs.
AVX2_EPYC = {"sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512_XEON = AVX2_EPYC | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"}
ZEN4 = AVX512_XEON | {"avx512_bf16", "avx512ifma", "avx512vbmi", "avx512_vbmi2", "avx512_bitalg", "avx512_vpopcntdq"}
AMX_XEON = ZEN4 | {"avx512_fp16", "amx_bf16", "amx_int8", "amx_tile"}


@pytest.mark.parametrize(
    ("flags", "best", "lower"),
    [
        (AVX2_EPYC, "avx2", ["generic"]),
        (AVX512_XEON, "avx512", ["avx2"]),
        (ZEN4, "avx512_bf16", ["avx512", "avx2"]),
        (AMX_XEON, "avx512_bf16", ["avx512", "avx2"]),
    ],
    ids=["avx2-epyc", "avx512-xeon", "zen4", "amx-xeon"],
)
def test_each_cpu_kind_builds_its_best_and_tests_every_lower_vector_target(monkeypatch, flags, best, lower):
    monkeypatch.setattr(cpu_ops.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: flags)
    monkeypatch.delenv("ORBITAL_CPU_ISA", raising=False)
    assert build_target() == best
    assert lower_test_targets() == lower
    monkeypatch.setattr(cpu_ops.platform, "machine", lambda: "aarch64")
    assert supported_targets() == ["generic"]


def test_build_folder_is_keyed_by_sources_target_torch_and_checkout(tmp_path):
    """Two checkouts with the same sources get their own builds (torch's ninja file names the
    sources' absolute paths: a shared one was rebuilt from scratch whenever the other loaded)."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "op.cpp").write_text("int f() { return 1; }\n")
    name = cpu_ops.build_dir_name
    assert name(a, "avx2", "2.13.0") == name(a, "avx2", "2.13.0")
    assert name(a, "avx2", "2.13.0") != name(b, "avx2", "2.13.0")
    assert name(a, "avx2", "2.13.0") != name(a, "generic", "2.13.0")
    assert name(a, "avx2", "2.13.0") != name(a, "avx2", "2.14.1")
    before = name(a, "avx2", "2.13.0")
    (a / "op.cpp").write_text("int f() { return 2; }\n")
    assert name(a, "avx2", "2.13.0") != before


def test_a_dead_builds_lock_does_not_hang_the_next_start():
    """torch's `lock` file, left in the build folder by a build that was killed, is removed under
    the flock (before, every later start waited on it forever)."""
    mod = load_cpu_ops()
    if mod is None:
        pytest.skip("no C++ ops here")
    build = Path(mod.__file__).parent
    (build / "lock").touch()
    code = "from engine.kernels.cpu_ops import load_cpu_ops; m = load_cpu_ops(); print(m.isa())"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == mod.isa(), out.stderr
        assert not (build / "lock").exists()
    finally:  # a failure must not leave the lock to hang the rest of the suite
        (build / "lock").unlink(missing_ok=True)


def test_forced_target_must_be_one_this_cpu_runs(monkeypatch, caplog):
    best = supported_targets()[0]
    monkeypatch.setenv("ORBITAL_CPU_ISA", "generic")
    assert build_target() == "generic"
    monkeypatch.setenv("ORBITAL_CPU_ISA", "avx9000")
    assert build_target() == best and "not available" in caplog.text


def test_this_process_runs_the_best_target_and_its_build_is_keyed_by_it():
    mod = load_cpu_ops()
    assert mod is not None and mod.isa() == build_target()
    assert any(d.name.startswith(f"cpu_ops-{mod.isa()}-") for d in Path(mod.__file__).parents[1].iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("target", LOWER)
def test_lower_target_passes_the_kernel_tests(target):
    env = {**os.environ, "ORBITAL_CPU_ISA": target}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
