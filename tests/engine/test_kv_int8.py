"""kv_cache_dtype="int8" through the engine: KV capacity at a fixed byte budget (through
stats()), perplexity on fixed prose within 0.5% of the float cache (the prose prefilled in
chunks, so later chunks read earlier ones from the int8 cache), prefix-cache hits and
preemption keeping the tokens, the KV dtype in the block hashes, and the disaggregated
hand-off moving the scales with the values (a float/int8 mismatch refused)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.block_hash import kv_hash_root, prompt_hit_hashes
from tests.engine.path_agreement import assert_paths_agree, rounding_bound
from tests.engine.test_kv_transfer import (
    LONG,
    LONGER,
    SHORT,
    _assert_pools_whole,
    _run_pd,
    assert_other_dtype_refused,
)
from tests.engine.test_quantization import agreement, assert_hits_and_preemption_keep_tokens, quality

ARGS = dict(num_threads=2, max_model_len=2048, max_num_batched_tokens=512)


def test_int8_holds_twice_bf16_and_four_times_float32_tokens_in_the_same_bytes():
    budget = 48 << 20
    tokens = {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8"), ("bfloat16", "int8")):
        llm = LLM(dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_bytes=budget, **ARGS)
        try:
            stats = llm.stats()
            tokens[dtype, kv] = stats["kv_capacity_tokens"]
            assert stats["kv_capacity_tokens"] == stats["num_blocks"] * 16
            per_token = llm.engine.core.executor.kv_bytes_per_block() / 16
            assert stats["num_blocks"] * per_token * 16 <= budget  # sized from the real bytes
        finally:
            llm.shutdown()
    print(tokens)
    assert tokens["float32", "int8"] == tokens["bfloat16", "int8"]  # the model dtype does not matter
    assert tokens["float32", "int8"] >= 1.9 * tokens["bfloat16", "auto"]
    assert tokens["float32", "int8"] >= 3.8 * tokens["float32", "auto"]


def kv_perplexity_change(kv_cache_dtype: str) -> float:
    """Relative perplexity change on the fixed prose of a quantized KV cache against the float
    cache (float32 model; the greedy agreement printed)."""
    kw = dict(dtype="float32", kv_cache_memory_bytes=256 << 20, **ARGS)
    (ppl_f, greedy_f), (ppl_q, greedy_q) = (quality(kv_cache_dtype=kv, **kw) for kv in ("auto", kv_cache_dtype))
    agree = agreement(greedy_f, greedy_q)
    print(
        f"perplexity float KV {ppl_f:.4f}, {kv_cache_dtype} KV {ppl_q:.4f} ({ppl_q / ppl_f - 1:+.3%}); agreement {agree:.0%}"
    )
    return ppl_q / ppl_f - 1


@pytest.mark.slow  # a perplexity over a long text: make test runs it, make test-fast does not
def test_int8_kv_perplexity_within_half_a_percent_of_the_float_cache():
    assert abs(kv_perplexity_change("int8")) < 0.005


@pytest.mark.slow
def test_int8_kv_with_prefix_cache_hits_and_preemption_keeps_its_tokens():
    assert_hits_and_preemption_keep_tokens(rounding={"kv_cache_dtype": "auto"}, kv_cache_dtype="int8")


def test_the_kv_dtype_salts_block_hashes_and_the_router_computes_the_same():
    ids = list(range(100, 180))
    plain, salted = prompt_hit_hashes(ids, 16), prompt_hit_hashes(ids, 16, root=kv_hash_root("int8"))
    assert len(plain) == len(salted) == 4 and not set(plain) & set(salted)
    assert kv_hash_root("auto") is None  # float caches keep the hashes they had
    llm = LLM(dtype="float32", kv_cache_dtype="int8", num_threads=2, max_model_len=256)
    try:
        eng = llm.engine
        [req] = eng.inputs.make_requests("h", ids, SamplingParams(max_tokens=1))
        eng.core.add_request(req)
        while eng.core.has_unfinished_requests():
            eng.core.step()
        assert req.block_hashes[:4] == salted
    finally:
        llm.shutdown()


@contextlib.contextmanager
def kv_hand_off(kv_cache_dtype: str) -> Iterator[SimpleNamespace]:
    """Colocated, prefill and decode engines with this KV cache dtype: 3 greedy prompts run
    colocated (`expected`) and through the P/D hand-off (`got`, the `moved` blocks); the engines
    are shut down after."""
    kw = dict(dtype="float32", kv_cache_dtype=kv_cache_dtype, num_threads=2, max_model_len=512)
    roles = [None, {"role": "prefill"}, {"role": "decode", "local_prefill_max_tokens": 16}]
    engines: list[LLM] = []
    try:
        for role in roles:
            engines.append(LLM(kv_transfer_config=role, **kw))
        colocated, prefill, decode = engines
        params = [SamplingParams(temperature=0, max_tokens=16, logprobs=2) for _ in range(3)]
        prompts = [SHORT, LONG, LONGER]
        expected = colocated.generate(prompts, params, use_tqdm=False)
        got, moved = _run_pd(decode, prefill, prompts, params)
        engines.append(LLM(**(kw | {"kv_cache_dtype": "auto"})))
        fine = engines[-1].generate(prompts, params, use_tqdm=False)
        bound = rounding_bound(expected, fine)
        yield SimpleNamespace(prefill=prefill, decode=decode, expected=expected, got=got, moved=moved, bound=bound)
    finally:
        for llm in engines:
            llm.shutdown()


@pytest.mark.slow
def test_int8_kv_hand_off_moves_the_scales_and_a_float_payload_is_refused():
    with kv_hand_off("int8") as h:
        assert_paths_agree(h.got, h.expected, h.bound)
        assert h.moved and all(blk.data.dtype == torch.int8 and blk.layout.dtype == "int8" for _, blk in h.moved)
        assert h.moved[0][1].data.shape[-1] == h.decode.engine.model_config.head_dim + 2  # values + scale
        _assert_pools_whole(h.decode, h.prefill)
        assert_other_dtype_refused(h.decode, "float32")  # a float cache's payload: refused
