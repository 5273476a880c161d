"""Build (once per source version and vector target, cached) and load the C++ CPU ops; None when
they cannot be built.

The module (sources in engine/kernels/cpu/) holds the paged decode and prompt-chunk attention
kernels, which read K/V straight from the paged cache, the paged cache write, the greedy
row argmax and the fused residual-add+RMSNorm, SiLU-and-mul and rotary steps. The vector code is
one source over a 16-lane vector (cpu/simd16.h) built for the best target this CPU has: AVX-512
(with BF16 where present) or AVX2 + FMA; elsewhere the ops decline (return false) and the layers
run PyTorch's path. Any build failure falls back to PyTorch too, and tests compare the two.
ORBITAL_DISABLE_CPU_KERNEL=1 turns the ops off; ORBITAL_CPU_ISA=avx2|avx512|generic builds a
lower target than the CPU's best (to test or compare paths).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
_LOCK = threading.Lock()
_MODULE = None
_TRIED = False
_SRC = Path(__file__).with_name("cpu")

# Explicit target flags, not -march=native: a build runs on every CPU with its target's flags, and
# the cache key names the target, so a home directory shared by nodes of two CPU kinds keeps one
# build per kind instead of loading one with illegal instructions on the other.
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = _AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
TARGETS: dict[str, tuple[list[str], set[str]]] = {  # name: (compiler flags, /proc/cpuinfo flags needed), best first
    "avx512_bf16": (
        _AVX512 + ["-mavx512bf16"],
        {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"},
    ),
    "avx512": (_AVX512, {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx2": (_AVX2, {"avx2", "fma", "f16c"}),
    "generic": ([], set()),
}


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def supported_targets() -> list[str]:
    """The targets this CPU can run, best first (always ends with generic)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["generic"]
    flags = cpu_flags()
    return [name for name, (_, needs) in TARGETS.items() if needs <= flags]


def lower_test_targets() -> list[str]:
    """The targets below this CPU's best that the tests also run: every lower vector target
    (avx512 and avx2 on an AVX-512 BF16 or AMX CPU, avx2 on an AVX-512 one), else generic (an
    AVX2 CPU). Each kind of CI machine so covers the paths of the kinds below it."""
    lower = supported_targets()[1:]
    vector = [t for t in lower if t != "generic"]
    return vector or lower


def build_target() -> str:
    """The CPU's best target, or ORBITAL_CPU_ISA when it names one this CPU can run."""
    supported = supported_targets()
    want = os.environ.get("ORBITAL_CPU_ISA")
    if want:
        if want in supported:
            return want
        log.warning(
            "ORBITAL_CPU_ISA=%s is not available on this CPU (it has %s); using %s", want, supported, supported[0]
        )
    return supported[0]


def build_flags(target: str) -> list[str]:
    return ["-O3", "-ffast-math", "-fopenmp", *TARGETS[target][0]]


def source_files(src: Path) -> list[Path]:
    return sorted(src.glob("*.cpp")) + sorted(src.glob("*.h"))


def build_dir_name(src: Path, target: str, torch_version: str) -> str:
    """The build's folder under the cache, keyed by the sources (names and bytes), the target's
    flags, torch's version and the sources' folder: an edited kernel, another CPU kind or another
    torch never reuses a stale build, and two checkouts sharing one cache (a work tree and an
    installed copy) do not share one either, since torch writes the sources' absolute paths into
    the build's ninja file and each would rebuild the other's from scratch on every load."""
    key = (
        b"".join(p.name.encode() + p.read_bytes() for p in source_files(src))
        + " ".join(build_flags(target)).encode()
        + torch_version.encode()
        + str(src.resolve()).encode()
    )
    return f"cpu_ops-{target}-{hashlib.sha256(key).hexdigest()[:12]}"


@contextlib.contextmanager
def _build_lock(build: Path):
    """Holds an flock on the build folder around torch's `load`. torch guards a build with a
    `lock` file that only the building process removes: a process killed mid-build (a replica
    stopped while it compiled) left it behind, and every later start waited on it forever. The
    kernel drops an flock with its process, and while this one holds it no other process is in
    `load` here, so a `lock` file found then is a dead build's and is removed."""
    with open(build / ".orbital-build.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (build / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_cpu_ops() -> ModuleType | None:
    global _MODULE, _TRIED
    if not _TRIED:  # the layers ask on every forward: no lock once the answer is known
        with _LOCK:
            if not _TRIED:
                _MODULE = _build()
                _TRIED = True  # set last: a reader without the lock never sees a load in progress
    return _MODULE


def _build():
    if os.environ.get("ORBITAL_DISABLE_CPU_KERNEL") == "1":
        return None
    try:
        import torch
        from torch.utils.cpp_extension import load

        from engine.model.gguf_convert import cache_root

        target = build_target()
        flags = build_flags(target)
        files = source_files(_SRC)
        build = cache_root() / "torch_extensions" / build_dir_name(_SRC, target, torch.__version__)
        build.mkdir(parents=True, exist_ok=True)
        with _build_lock(build):
            mod = load(
                name="orbital_cpu_ops",
                sources=[str(p) for p in files if p.suffix == ".cpp"],
                build_directory=str(build),
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        if mod.isa() != target:
            raise RuntimeError(f"built for {target} but the module reports {mod.isa()}")
        return mod
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, ...: use the PyTorch path
        log.warning("CPU kernels unavailable (%s); using the PyTorch path", e)
        return None


def cpu_ops_for(x: torch.Tensor) -> object | None:
    """The ops module for a CPU tensor (None for other devices or when the ops are unavailable)."""
    return load_cpu_ops() if x.device.type == "cpu" else None


if __name__ == "__main__":  # `python -m engine.kernels.cpu_ops [--lower]`: build now, say which path
    import subprocess
    import sys

    logging.basicConfig(level=logging.INFO)
    if "--lower" in sys.argv[1:]:  # `make test` builds the tests' lower targets up front too
        targets = lower_test_targets()
        if not targets:
            raise SystemExit("orbital CPU ops: no lower target on this CPU")
        for target in targets:  # one process each: a process loads one build of the module
            env = {**os.environ, "ORBITAL_CPU_ISA": target}
            subprocess.run([sys.executable, "-m", "engine.kernels.cpu_ops"], env=env, check=True)
        raise SystemExit(0)
    mod = load_cpu_ops()
    print(f"orbital CPU ops: {mod.isa() if mod is not None else 'unavailable (PyTorch fallback)'}")
