"""The Triton paged kernel against the reference backend on CPU, through Triton's interpreter:
the kernel's indexing and masking are checked without a GPU wherever the `triton` package
imports (CPU CI has no Triton and skips with the reason; the GPU tests run it compiled)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel module is imported
triton = pytest.importorskip("triton", reason="the triton package is not installed")

from engine.layers.attention.reference import ReferenceAttentionBackend  # noqa: E402
from engine.layers.attention.triton_paged import TritonPagedAttentionBackend  # noqa: E402
from tests.engine.paged_cases import make_step, random_cache, run_backend  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the GPU tests run the compiled kernel")


def _interpreter_works() -> bool:
    # Triton 3.6's interpreter turns 1-element arrays into ints, which numpy >= 2.4 refuses.
    states, counts = make_step([1], [], 4, 4)
    try:
        run_backend(
            TritonPagedAttentionBackend(), states, counts, random_cache(1, 4, 4, 16, torch.float32, "cpu"), 1, 1.0
        )
    except triton.runtime.errors.InterpreterError:
        return False
    return True


@pytest.mark.parametrize("hkv,g,d,bs", [(3, 3, 64, 16), (2, 4, 32, 8), (1, 1, 16, 4)])
def test_interpreted_kernel_matches_reference(hkv, g, d, bs):
    if not _interpreter_works():
        pytest.skip("Triton's interpreter does not run with this numpy")
    states, counts = make_step([0, 5, 16, 40], [(0, 23), (17, 9), (32, 40)], bs, 80)
    cache = random_cache(hkv, 80, bs, d, torch.float32, "cpu")
    ref, ref_cache = run_backend(ReferenceAttentionBackend(), states, counts, cache, hkv * g, d**-0.5)
    got, got_cache = run_backend(TritonPagedAttentionBackend(), states, counts, cache, hkv * g, d**-0.5)
    assert torch.equal(ref_cache, got_cache)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
