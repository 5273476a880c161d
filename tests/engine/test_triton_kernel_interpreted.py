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
from tests.engine.paged_cases import make_step, random_cache, random_quant_cache, run_backend  # noqa: E402

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


@pytest.mark.parametrize("storage", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("hkv,g,d,bs", [(3, 3, 64, 16), (1, 1, 16, 4)])
def test_interpreted_kernel_reads_quantized_rows(storage, hkv, g, d, bs, monkeypatch):
    """int8/fp8 rows with their scales, read as they are, against the reference's dequantized
    gather (both caches equal byte for byte after the step's writes)."""
    if not _interpreter_works():
        pytest.skip("Triton's interpreter does not run with this numpy")
    if storage == torch.float8_e4m3fn:  # the interpreter's float32 -> e4m3 is wrong (see below)
        monkeypatch.setattr(TritonPagedAttentionBackend, "write_kv", ReferenceAttentionBackend.write_kv)
    states, counts = make_step([0, 5, 16, 40], [(0, 23), (17, 9), (32, 40)], bs, 80)
    cache = random_quant_cache(hkv, 80, bs, d, storage, "cpu")
    args = (states, counts, cache, hkv * g, d**-0.5)
    ref, ref_cache = run_backend(ReferenceAttentionBackend(), *args, dtype=torch.float32)
    got, got_cache = run_backend(TritonPagedAttentionBackend(), *args, dtype=torch.float32)
    assert torch.equal(ref_cache.view(torch.uint8), got_cache.view(torch.uint8))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("storage", [torch.int8, torch.float8_e4m3fn])
def test_interpreted_quantized_write_matches_quantize_rows(storage):
    """The Triton write stores the bytes `quantize_rows` makes (ties, zeros, tiny and huge rows)."""
    from engine.layers.attention.reference import write_kv
    from engine.layers.attention.triton_kv_write import write_quantized_kv

    if not _interpreter_works():
        pytest.skip("Triton's interpreter does not run with this numpy")
    if storage == torch.float8_e4m3fn:
        pytest.skip("Triton 3.6's interpreter turns float32 128.0 into e4m3 64.0; the GPU tests check this write")
    g = torch.Generator().manual_seed(3)
    t, hkv, d = 7, 3, 64
    k, v = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g) * 1e-3
    k[0] = 0.0  # an all-zero row: scale 0, values 0
    k[1, :, :4] = torch.tensor([127.0, 0.5, -1.5, 2.5])  # exact halves after scaling: ties
    v[2] *= 1e6
    slots = torch.tensor([3, 17, 0, 40, 41, 9, 22])
    ref = torch.zeros(2, hkv, 6, 8, d + 2, dtype=storage)
    got = ref.clone()
    write_kv(ref, k, v, slots)
    write_quantized_kv(got, k, v, slots)
    assert torch.equal(ref.view(torch.uint8), got.view(torch.uint8))
