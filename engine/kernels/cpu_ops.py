"""Build (once per source version, cached) and load the C++ CPU ops; None when they cannot be built.

The module (sources in engine/kernels/cpu/) holds the paged decode and prompt-chunk attention
kernels, which read K/V straight from the paged cache, the paged cache write, the greedy
row argmax and the fused residual-add+RMSNorm, SiLU-and-mul and rotary steps (AVX-512; each
returns false where it does not apply). It is optional: any build failure falls back to the
pure-PyTorch path, and tests compare the two. ORBITAL_DISABLE_CPU_KERNEL=1 turns it off.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)
_LOCK = threading.Lock()
_MODULE = None
_TRIED = False
_SRC = Path(__file__).with_name("cpu")


def load_cpu_ops():
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
        from torch.utils.cpp_extension import load

        from engine.model.gguf_convert import cache_root

        files = sorted(_SRC.glob("*.cpp")) + sorted(_SRC.glob("*.h"))
        # Named by the sources' hash: an edited kernel never reuses a stale build, and builds of
        # different versions never collide.
        digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()[:12]
        build = cache_root() / "torch_extensions" / f"cpu_ops-{digest}"
        build.mkdir(parents=True, exist_ok=True)
        return load(name="orbital_cpu_ops", sources=[str(p) for p in files if p.suffix == ".cpp"],
                    build_directory=str(build), extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, ...: use the PyTorch path
        log.warning("CPU kernels unavailable (%s); using the PyTorch path", e)
        return None


def cpu_ops_for(x) -> object | None:
    """The ops module for a CPU tensor (None for other devices or when the ops are unavailable)."""
    return load_cpu_ops() if x.device.type == "cpu" else None


if __name__ == "__main__":  # `python -m engine.kernels.cpu_ops`: build now, say which path
    logging.basicConfig(level=logging.INFO)
    mod = load_cpu_ops()
    print(f"orbital CPU ops: {mod.isa() if mod is not None else 'unavailable (PyTorch fallback)'}")
