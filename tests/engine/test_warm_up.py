"""Warm-up before serving (engine/runner/warm_up.py): the row counts it runs cover every bucket,
and after it the first requests build no linear kernel (oneDNN reports each kernel it creates
when ONEDNN_VERBOSE is set; without the warm-up the same requests create some)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from engine.layers.packed_gemm import bf16_gemm_native, packing_enabled, row_bucket
from engine.runner.warm_up import WARM_ROWS, row_counts


def test_row_counts_are_every_bucket_up_to_the_bound():
    for bound in (1, 7, 64, 300, WARM_ROWS):
        counts = row_counts(bound)
        assert counts == sorted(set(counts))
        assert {row_bucket(m) for m in range(1, bound + 1)} == set(counts)


SERVE = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    llm = LLM(dtype=sys.argv[1], num_threads=1, warmup=sys.argv[2] == "on", max_num_seqs=16)
    print("=== serving", flush=True)
    for n in (37, 150, 300):  # prompts of three buckets, then decode steps
        llm.generate({"prompt_token_ids": list(range(100, 100 + n))}, SamplingParams(max_tokens=3, temperature=0))
    print("=== done", flush=True)
    """
)


def _kernels_built_while_serving(dtype: str, warmup: str) -> list[str]:
    env = {**os.environ, "ONEDNN_VERBOSE": "2"}
    out = subprocess.run(
        [sys.executable, "-c", SERVE, dtype, warmup], capture_output=True, text=True, env=env, timeout=600, check=True
    ).stdout
    serving = out.split("=== serving", 1)[1].split("=== done", 1)[0]
    return [
        line for line in serving.splitlines() if "cache_miss" in line and ("inner_product" in line or "matmul" in line)
    ]


DTYPES = ["float32"] + (["bfloat16"] if bf16_gemm_native() else [])


@pytest.mark.slow
@pytest.mark.skipif(not packing_enabled(torch.float32, torch.device("cpu")), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("dtype", DTYPES)
def test_first_requests_build_no_linear_kernel_after_the_warm_up(dtype):
    assert _kernels_built_while_serving(dtype, "off"), "the same requests build kernels without the warm-up"
    assert _kernels_built_while_serving(dtype, "on") == []
