"""Disaggregated prefill/decode at engine level, in one process: a decode engine asks for the KV
of long uncached prompts, a prefill engine computes and reads it out, the decode engine writes
it into its blocks and goes on. Outputs equal the colocated engine's (and transformers' greedy),
only the missing blocks move, failed loads recompute or fail cleanly, and every block returns.
The serving path (Ray, Serve, HTTP) is tested in tests/router/test_disaggregated.py."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.kv_transfer.blocks import KVBlocks, KVLayout
from tests.engine.hf_reference import hf_greedy

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

LOCAL_MAX = 16  # uncached suffixes up to this many tokens are prefilled by the decode engine
TEXT = (
    "Orbital serves language models on a cluster of machines. Each replica runs a paged key-value "
    "cache, continuous batching and prefix caching, and replicas of the prefill pool hand the cache "
    "of long prompts to replicas of the decode pool, which stream the tokens to clients. "
)
SHORT = "The capital of France is"
LONG = TEXT + "Summarise this in one sentence:"
LONGER = TEXT * 2 + "List three facts about it:"


def _llm(**kw) -> LLM:
    return LLM(dtype="float32", num_threads=2, max_model_len=512, kv_cache_memory_bytes=24 << 20, **kw)


@pytest.fixture(scope="module")
def colocated():
    return _llm()


@pytest.fixture(scope="module")
def prefill():
    return _llm(kv_transfer_config={"role": "prefill"})


@pytest.fixture(scope="module")
def decode():
    return _llm(kv_transfer_config={"role": "decode", "local_prefill_max_tokens": LOCAL_MAX})


def _prefill_kv(prefill: LLM, load) -> KVBlocks:
    """What a prefill replica does for one load: compute the tokens, read out the blocks."""
    eng = prefill.engine
    [req] = eng.inputs.make_requests(f"p-{load.request_id}", load.prompt_token_ids, SamplingParams(max_tokens=1))
    req.kv_export_first_block = load.first_block
    eng.core.add_request(req)
    while True:
        for co in eng.core.step():
            if co.request_id == req.request_id and co.finished:
                assert co.kv_blocks is not None, co
                return co.kv_blocks


def _run_pd(decode: LLM, prefill: LLM, prompts, params, on_load=None):
    """Generate on the decode engine, serving its loads from the prefill engine (or `on_load`)."""
    eng = decode.engine
    ids = [eng.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    done, moved = {}, []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        for load in eng.core.take_kv_loads():
            if on_load is not None and on_load(eng.core, load):
                continue
            blocks = _prefill_kv(prefill, load)
            moved.append((load, blocks))
            eng.core.load_kv(load.request_id, blocks)
    return [done[i] for i in ids], moved


def _assert_pools_whole(*llms: LLM) -> None:
    for llm in llms:
        sched = llm.engine.core.scheduler
        sched.check_integrity()
        assert sched.kv_cache_manager.block_pool.get_num_used_blocks() == 0
        assert sched.num_waiting_for_remote_kv == 0


def _same(a, b, logprob_tol: float = 1e-4) -> None:
    assert len(a.outputs) == len(b.outputs)
    for ca, cb in zip(a.outputs, b.outputs):
        assert ca.token_ids == cb.token_ids and ca.text == cb.text
        assert ca.finish_reason == cb.finish_reason and ca.stop_reason == cb.stop_reason
        if ca.logprobs is not None:
            for la, lb in zip(ca.logprobs, cb.logprobs):
                assert la.token_id == lb.token_id and la.logprob == pytest.approx(lb.logprob, abs=logprob_tol)
                assert [t for t, _ in la.top] == [t for t, _ in lb.top]


def test_outputs_equal_colocated_and_transformers(colocated, prefill, decode, hf_smollm):
    prompts = [SHORT, LONG, LONG, LONGER, LONGER, SHORT]
    params = [
        SamplingParams(temperature=0, max_tokens=24, logprobs=2),
        SamplingParams(temperature=0, max_tokens=24, logprobs=2),
        SamplingParams(temperature=0, max_tokens=40, stop=["."]),
        SamplingParams(temperature=0, max_tokens=16, n=2),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, seed=1234),
        SamplingParams(temperature=0.9, max_tokens=24, seed=99, n=2),
    ]
    ref = colocated.generate(prompts, params, use_tqdm=False)
    got, moved = _run_pd(decode, prefill, prompts, params)
    for a, b in zip(ref, got):
        _same(a, b)
    # Long prompts went remote (n=2: each sibling), short ones stayed local.
    assert len(moved) >= 4
    stats = decode.stats()
    assert stats["num_remote_prefills"] == len(moved) and stats["num_local_prefills"] >= 2
    # Greedy equals transformers' too, for a prompt whose KV came from the prefill engine.
    tok = decode.tokenizer
    prompt_ids = tok(LONG)["input_ids"]
    hf_ids, hf_lps = hf_greedy(hf_smollm, prompt_ids, 24, tok.eos_token_id)
    assert got[1].outputs[0].token_ids == hf_ids
    for lp, want in zip(got[1].outputs[0].logprobs, hf_lps):
        assert lp.logprob == pytest.approx(want, abs=1e-3)
    _assert_pools_whole(decode, prefill)


def test_only_missing_blocks_move(colocated, prefill, decode):
    """A prompt whose prefix the decode engine holds: only the blocks past it are asked for,
    and the bytes moved are those blocks' bytes."""
    decode.engine.core.scheduler.reset_prefix_cache()
    sp = SamplingParams(temperature=0, max_tokens=12)
    _, first = _run_pd(decode, prefill, [TEXT * 2], [sp])
    assert len(first) == 1 and first[0][0].first_block == 0
    extended = (
        TEXT * 2 + "Now list three facts about the prefill pool, three about the decode pool, and say which streams:"
    )
    ref = colocated.generate([extended], [sp], use_tqdm=False)
    got, moved = _run_pd(decode, prefill, [extended], [sp])
    _same(ref[0], got[0])
    [(load, blocks)] = moved
    bs = decode.engine.core.scheduler.block_size
    a, b = decode.tokenizer(TEXT * 2)["input_ids"], decode.tokenizer(extended)["input_ids"]
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    held = common // bs  # full blocks of the earlier prompt that start this one
    assert load.first_block == held > 0
    need = -(-load.num_tokens // bs)  # blocks holding prompt[:-1]
    assert blocks.num_blocks == load.num_blocks == need - held
    assert blocks.nbytes == blocks.num_blocks * blocks.layout.bytes_per_block
    assert blocks.layout.bytes_per_block == decode.engine.core.executor.kv_bytes_per_block()
    _assert_pools_whole(decode, prefill)


def test_failed_load_recomputes_or_fails(colocated, prefill, decode):
    decode.engine.core.scheduler.reset_prefix_cache()
    sp = SamplingParams(temperature=0, max_tokens=16)
    ref = colocated.generate([LONG + " Again:"], [sp], use_tqdm=False)

    def recompute(core, load):
        core.kv_load_failed(load.request_id)
        return True

    got, moved = _run_pd(decode, prefill, [LONG + " Again:"], [sp], on_load=recompute)
    assert not moved
    _same(ref[0], got[0])
    decode.engine.core.scheduler.reset_prefix_cache()

    def fail(core, load):
        core.kv_load_failed(load.request_id, error="prefill replica died")
        return True

    [out], _ = _run_pd(decode, prefill, [LONG + " Again:"], [sp], on_load=fail)
    assert out.outputs[0].finish_reason == "error" and "prefill replica died" in (out.error or "")
    _assert_pools_whole(decode, prefill)


def test_abort_while_waiting_and_late_kv(prefill, decode):
    """An abort while the KV is in flight frees the blocks; the late payload is dropped."""
    decode.engine.core.scheduler.reset_prefix_cache()
    eng = decode.engine
    rid = eng.add_request(None, LONGER + " Late:", SamplingParams(temperature=0, max_tokens=8))
    eng.step()
    [load] = eng.core.take_kv_loads()
    assert eng.core.scheduler.num_waiting_for_remote_kv == 1
    assert eng.core.scheduler.kv_cache_manager.block_pool.get_num_used_blocks() > 0
    eng.abort_request(rid)
    eng.core.load_kv(load.request_id, _prefill_kv(prefill, load))  # arrives after the abort
    eng.step()
    assert not eng.has_unfinished_requests()
    _assert_pools_whole(decode, prefill)


def assert_other_dtype_refused(decode: LLM, dtype: str) -> None:
    """A payload of a cache in `dtype` for a long prompt's load: refused with a clear error; the
    request, aborted, leaves the pool whole."""
    decode.engine.core.scheduler.reset_prefix_cache()
    eng = decode.engine
    rid = eng.add_request(None, LONGER + " Mismatch:", SamplingParams(temperature=0, max_tokens=4))
    eng.step()
    [load] = eng.core.take_kv_loads()
    good = eng.core.kv_layout
    bad = KVLayout(good.num_layers, good.num_kv_heads, good.head_dim, good.block_size, dtype)
    shape = (good.num_layers, 2, good.num_kv_heads, load.num_blocks, good.block_size, bad.row_width)
    with pytest.raises(InvalidRequestError, match="KV layouts differ"):
        eng.core.load_kv(load.request_id, KVBlocks(bad, load.first_block, load.num_tokens, torch.zeros(shape)))
    eng.abort_request(rid)
    eng.step()
    _assert_pools_whole(decode)


def test_mismatched_layout_is_refused(decode):
    assert_other_dtype_refused(decode, "bfloat16")
    assert_other_dtype_refused(decode, "int8")


def test_speculative_decoding_on_the_decode_pool(colocated, prefill):
    """A decode engine that drafts (n-gram, always k=4) takes remote KV as any other: greedy text
    equals the colocated engine's without speculation, drafts were verified, pools whole."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    decode = _llm(kv_transfer_config={"role": "decode", "local_prefill_max_tokens": LOCAL_MAX}, speculative_config=spec)
    try:
        prompts = [LONG, LONGER + " Repeat the first sentence exactly:", SHORT]
        params = [SamplingParams(temperature=0, max_tokens=24) for _ in prompts]
        expected = colocated.generate(prompts, params, use_tqdm=False)
        got, moved = _run_pd(decode, prefill, prompts, params)
        for a, b in zip(got, expected):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].text == b.outputs[0].text
        assert len(moved) == 2 and decode.stats()["spec_num_draft_tokens"] > 0
        _assert_pools_whole(decode, prefill)
    finally:
        decode.shutdown()


def test_embeddings_on_the_decode_pool(colocated, prefill, decode):
    """`last` pooling uses the remote prefill like generation (the last token, whose hidden state
    is pooled, is computed here); `mean` needs every position's hidden state, so it prefills
    locally. Both equal the colocated engine's vectors: float32 paths that differ in sum order
    only, held to the L2 bound tests/router/test_embeddings_http.py derives for this model."""
    for pooling, remote in (("last", True), ("mean", False)):
        text = f"A {pooling} pooled embedding maps a text to one vector of numbers. " * 6  # not cached yet
        ref = colocated.embed([text], pooling=pooling)[0].embedding
        params = SamplingParams(max_tokens=1, pooling=pooling)
        [got], moved = _run_pd(decode, prefill, [text], [params])
        assert bool(moved) == remote, pooling
        assert got.outputs[0].token_ids == [] and got.outputs[0].finish_reason == "stop"
        dist = torch.linalg.vector_norm(torch.tensor(got.embedding) - torch.tensor(ref)).item()
        assert dist < 1e-3, (pooling, dist)
    _assert_pools_whole(decode, prefill)
