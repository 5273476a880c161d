"""The Triton paged backend against the reference backend on CUDA, and the backend choice there."""

from __future__ import annotations

import pytest
import torch

from engine.layers.attention.selector import get_backend
from tests.engine.paged_cases import make_step, random_cache, run_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = {  # decode contexts, (cached, new) prompt chunks
    "mixed": ([0, 1, 15, 16, 17, 100, 333], [(0, 1), (0, 37), (16, 16), (45, 130), (700, 3)]),
    "decode_only": ([5 * i + 1 for i in range(200)], []),
    "long": ([3000, 1], [(0, 600), (2500, 300)]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,g,d,bs", [(3, 3, 64, 16), (8, 4, 128, 16), (2, 1, 64, 32), (1, 8, 96, 8)])
def test_triton_paged_matches_reference(case, dtype, hkv, g, d, bs):
    decode, chunks = CASES[case]
    states, counts = make_step(decode, chunks, bs, 16000)
    cache = random_cache(hkv, 16000, bs, d, dtype, "cuda")
    ref, ref_cache = run_backend(get_backend("reference", "cuda"), states, counts, cache, hkv * g, d**-0.5)
    got, got_cache = run_backend(get_backend("triton_paged", "cuda"), states, counts, cache, hkv * g, d**-0.5)
    assert torch.equal(ref_cache, got_cache)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), ref.float(), **tol)


def test_auto_picks_triton_on_cuda():
    assert get_backend("auto", "cuda").name == "triton_paged"
