"""The offload tier on CUDA (engine/kv_offload/): the host medium in pinned memory and the disk
medium, each rank's I/O on its thread and side stream beside the step's forward. A prompt whose
blocks were evicted comes back from the tier with the pool hit's tokens and logprobs, and every
block returns to the pool. The model is a random-weight SmolLM2-shaped Llama saved by the test."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# 497 tokens: 31 full blocks of 16 and the last token, which a hit always computes, so a pool hit
# and a tier hit run the very same step.
PROMPT = list(range(300, 300 + 2 * 497, 2))
OTHERS = [[7000 + 13 * i + k for i in range(500)] for k in range(2)]  # each evicts PROMPT's blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from bench.random_llama import save_random_llama

    path = tmp_path_factory.mktemp("smollm2_random_offload")
    save_random_llama(path, "smollm2-135m", torch.float32, init_range=0.05)
    torch.cuda.empty_cache()
    return path


def _gen(llm: LLM, prompt: list[int]):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    [o] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    c = o.outputs[0]
    return c.token_ids, [lp.logprob for lp in c.logprobs], o.num_cached_tokens


@pytest.mark.parametrize("medium", ["host", "disk"])
def test_an_evicted_prompt_comes_back_from_the_tier(model_dir, medium):
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cuda",
        num_blocks=40,
        block_size=16,
        kv_offload_bytes=256 << 20,
        kv_offload_medium=medium,
    )
    try:
        runner = llm.engine.core.executor.runner
        assert runner.offload_io.background  # CUDA's way: the I/O thread and its side stream
        if medium == "host":
            assert runner.offload.buf.is_pinned()
        _gen(llm, PROMPT)
        pool_hit = _gen(llm, PROMPT)
        assert pool_hit[2] == 496
        for p in OTHERS:
            _gen(llm, p)
        tier_hit = _gen(llm, PROMPT)
        # The same KV bytes as the pool hit, the same last-token step: the same outputs.
        assert tier_hit[0] == pool_hit[0] and tier_hit[2] == 496
        assert tier_hit[1] == pool_hit[1]
        st = llm.stats()
        assert st["offload_blocks_loaded"] >= 30 and st["offload_load_failures"] == 0
        assert st["blocks_used"] == 0
        llm.engine.core.scheduler.check_integrity()
    finally:
        llm.shutdown()
