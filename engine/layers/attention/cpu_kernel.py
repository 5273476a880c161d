"""Build (once, cached) and load the C++ paged decode kernel; None when it cannot be built.

The kernel reads K/V straight from the paged cache, so decode attention touches each cached
byte once instead of gather-copy-then-read. It is optional: any build failure falls back to
the pure-PyTorch reference path, and tests compare the two.
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


def load_paged_decode():
    global _MODULE, _TRIED
    with _LOCK:
        if _TRIED:
            return _MODULE
        _TRIED = True
        if os.environ.get("ORBITAL_DISABLE_CPU_KERNEL") == "1":
            return None
        try:
            from torch.utils.cpp_extension import load

            from engine.model.gguf_convert import cache_root

            here = Path(__file__).parent
            src = here / "paged_decode_cpu.cpp"
            # The build folder is named by the sources' hash: an edited kernel (or header) never
            # reuses a stale build, and builds of different versions never collide.
            digest = hashlib.sha256(b"".join(p.read_bytes() for p in (src, here / "paged_decode_avx512.h"))).hexdigest()[:12]
            build = cache_root() / "torch_extensions" / f"paged_decode_cpu-{digest}"
            build.mkdir(parents=True, exist_ok=True)
            _MODULE = load(name="orbital_paged_decode_cpu", sources=[str(src)], build_directory=str(build),
                           extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"], extra_ldflags=["-fopenmp"],
                           verbose=False)
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja, ...: use the reference path
            log.warning("CPU paged-attention kernel unavailable (%s); using the PyTorch path", e)
            _MODULE = None
        return _MODULE
