"""The offload tier end to end (tp=1, float32, a tiny random Llama): a prompt whose blocks were
evicted comes back from the tier instead of being recomputed, with the very outputs a pool hit
gives (the KV bytes are copied unchanged); a full tier drops its oldest blocks, a corrupted or
removed file is recomputed, and every block returns to the pool. Preemption, chunked prefill,
prompt logprobs and speculative decoding give the tier-off outputs with the tier on."""

from __future__ import annotations

import os
import threading

import pytest

from engine import LLM, SamplingParams
from engine.kv_offload.store import OffloadStore
from tests.tiny_llama import save_tiny_llama

BS = 4
BLOCK_BYTES = 2 * 2 * 4 * BS * 8 * 4  # layers x K/V x KV heads x block x head_dim x float32
A = [(7 * i + 3) % 500 for i in range(29)]  # 29 tokens: 7 full blocks hit, no tail hit after them
OTHERS = [[(11 * i + 5 + 97 * k) % 500 for i in range(30)] for k in range(3)]
PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=2)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm_dir):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-offload"), tokenizer_from=smollm_dir)


def make_llm(tiny_dir, offload_blocks: int = 64, num_blocks: int = 16, **kw) -> LLM:
    args = {"dtype": "float32", "block_size": BS, "max_num_batched_tokens": 64, "num_threads": 1, **kw}
    return LLM(str(tiny_dir), num_blocks=num_blocks, kv_offload_bytes=offload_blocks * BLOCK_BYTES, **args)


def gen(llm: LLM, prompt: list[int], params: SamplingParams = PARAMS):
    """(token ids, [(logprob, top-2)] per token, prompt tokens cached)."""
    [o] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    c = o.outputs[0]
    return c.token_ids, [(lp.logprob, lp.top) for lp in c.logprobs], o.num_cached_tokens


def evict(llm: LLM) -> None:
    for p in OTHERS:
        gen(llm, p)


def check_pool(llm: LLM) -> None:
    assert llm.engine.stats()["blocks_used"] == 0
    llm.engine.core.scheduler.check_integrity()


def test_evicted_prompt_comes_back_from_the_tier_bit_for_bit(tiny_dir):
    llm = make_llm(tiny_dir)
    off = make_llm(tiny_dir, offload_blocks=0)
    try:
        first = gen(llm, A)
        pool_hit = gen(llm, A)  # its blocks still in the pool
        assert pool_hit[2] == 28
        evict(llm)
        assert llm.engine.stats()["offload_blocks_saved"] >= 7
        tier_hit = gen(llm, A)
        # The same KV bytes as the pool hit: tokens and logprobs equal bit for bit.
        assert tier_hit[:2] == pool_hit[:2] and tier_hit[2] == 28
        assert tier_hit[0] == first[0]
        st = llm.engine.stats()
        assert st["prefix_cache_hits_offload"] == 28 and st["offload_blocks_loaded"] == 7
        assert st["offload_load_failures"] == 0
        check_pool(llm)
        # Tier off: the same traffic recomputes the whole prompt.
        gen(off, A), gen(off, A)
        evict(off)
        again = gen(off, A)
        assert again[2] == 0 and again[0] == first[0]
        assert off.engine.stats()["offload_capacity_blocks"] == 0
        check_pool(off)
    finally:
        llm.engine.shutdown()
        off.engine.shutdown()


def test_loads_run_on_the_io_thread_beside_the_forward(tiny_dir, monkeypatch):
    """The I/O thread (CUDA's way, rank_io.py; a CPU runs the I/O on the step thread): a step
    that loads one request's blocks from the tier and runs another's forward runs the loads on
    the rank's I/O thread while the step thread runs the forward. Each read here waits for that
    forward to begin, and sees it begin (on the step thread it would wait in vain: the forward
    starts after the step's loads). Outputs are the pool hit's, bit for bit."""
    llm = make_llm(tiny_dir)
    try:
        runner = llm.engine.core.executor.runner
        assert not runner.offload_io.background  # a CPU's default
        runner.offload_io.background = True
        pool_hit = (gen(llm, A), gen(llm, A))[1]
        evict(llm)
        began = threading.Event()
        reads = []  # (thread, whether the forward had begun) of each block read from the tier
        forward, read = runner.model.forward, OffloadStore.read

        def spied_forward(*args, **kwargs):
            began.set()
            return forward(*args, **kwargs)

        def read_once_the_forward_began(store, *args):
            reads.append((threading.current_thread().name, began.wait(timeout=5)))
            return read(store, *args)

        monkeypatch.setattr(runner.model, "forward", spied_forward)
        monkeypatch.setattr(OffloadStore, "read", read_once_the_forward_began)
        other = [(13 * i + 1) % 500 for i in range(12)]
        _, got = llm.generate([{"prompt_token_ids": other}, {"prompt_token_ids": A}], PARAMS, use_tqdm=False)
        c = got.outputs[0]
        assert (c.token_ids, [(lp.logprob, lp.top) for lp in c.logprobs]) == pool_hit[:2]
        assert got.num_cached_tokens == 28 and len(reads) == 7
        assert all(name.startswith("kv-offload-io") and saw for name, saw in reads), reads
        check_pool(llm)
    finally:
        llm.engine.shutdown()


def test_tier_full_drops_the_oldest_and_recomputes_them(tiny_dir):
    llm = make_llm(tiny_dir, offload_blocks=8)
    try:
        first = gen(llm, A)
        evict(llm)  # 3 x 8 blocks evicted into 8 slots: A's are dropped
        st = llm.engine.stats()
        assert st["offload_blocks_held"] == 8 and st["offload_blocks_dropped"] > 0
        again = gen(llm, A)
        assert again == first[:2] + (0,)  # recomputed as the first run was: bit for bit
        check_pool(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("damage", ["corrupt", "remove", "truncate"])
def test_a_damaged_tier_file_is_recomputed(tiny_dir, damage):
    llm = make_llm(tiny_dir)
    try:
        first = gen(llm, A)
        evict(llm)
        store = llm.engine.core.executor.runner.offload
        if damage == "corrupt":  # flip bytes inside every slot's payload
            with open(store.path, "r+b") as f:
                for slot in range(store.num_slots):
                    f.seek(slot * store.stride + 64 + 100)
                    f.write(os.urandom(16))
        elif damage == "remove":
            os.unlink(store.path)
        else:
            os.truncate(store.path, store.stride)
        again = gen(llm, A)
        assert again == first[:2] + (0,)  # recomputed whole, as the first run: bit for bit
        st = llm.engine.stats()
        assert st["offload_load_failures"] == 7 and st["prefix_cache_hits_offload"] == 0
        check_pool(llm)
    finally:
        llm.engine.shutdown()


def test_shutdown_removes_the_temporary_files(tiny_dir):
    llm = make_llm(tiny_dir)
    path = llm.engine.core.executor.runner.offload.path
    assert os.path.exists(path)
    llm.engine.shutdown()
    assert not os.path.exists(os.path.dirname(path))


def test_host_medium_and_a_set_directory(tiny_dir, tmp_path):
    host = make_llm(tiny_dir, kv_offload_medium="host")
    disk = make_llm(tiny_dir, kv_offload_dir=str(tmp_path))
    try:
        assert host.engine.core.executor.runner.offload.path is None
        assert os.path.dirname(disk.engine.core.executor.runner.offload.path) == str(tmp_path)
        for llm in (host, disk):
            first = gen(llm, A)
            evict(llm)
            assert gen(llm, A)[0] == first[0] and llm.engine.stats()["prefix_cache_hits_offload"] == 28
            check_pool(llm)
    finally:
        host.engine.shutdown()
        disk.engine.shutdown()
    assert os.listdir(tmp_path) == []


def _mixed(llm: LLM) -> list:
    """Concurrent repeats in a pool too small for them (preemption), chunked prefill, a request
    with prompt logprobs, then the same again after the pool turned over."""
    prompts = [A, OTHERS[0], A[:20] + OTHERS[1][:14], OTHERS[2], A]
    params = [PARAMS] * 4 + [SamplingParams(temperature=0, max_tokens=8, logprobs=1, prompt_logprobs=1)]
    out = []
    for _ in range(2):
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        out += [r.outputs[0].token_ids for r in res]
        evict(llm)
    return out


@pytest.mark.parametrize("spec", [None, "ngram:2"])
def test_preemption_chunks_prompt_logprobs_and_spec_decode_with_the_tier(tiny_dir, spec):
    kw = dict(num_blocks=24, max_num_batched_tokens=16, speculative_config=spec)
    on, off = make_llm(tiny_dir, **kw), make_llm(tiny_dir, offload_blocks=0, **kw)
    try:
        assert _mixed(on) == _mixed(off)
        st = on.engine.stats()
        assert st["prefix_cache_hits_offload"] > 0 and st["num_preemptions"] > 0
        check_pool(on)
        check_pool(off)
    finally:
        on.engine.shutdown()
        off.engine.shutdown()


def test_embeddings_with_the_tier(tiny_dir):
    """A `last`-pooled embedding takes the tier's blocks and returns, bit for bit, what a pool hit
    returns (the same KV bytes); a `mean`-pooled one reads every prompt position's hidden state,
    so it takes no tier hit and returns what it returned the first time."""
    llm = make_llm(tiny_dir)
    try:
        mean = llm.embed([{"prompt_token_ids": A}], pooling="mean")[0].embedding
        llm.embed([{"prompt_token_ids": A}], pooling="last")
        pool_hit = llm.embed([{"prompt_token_ids": A}], pooling="last")[0]
        assert pool_hit.num_cached_tokens == 28
        evict(llm)
        loaded = llm.engine.stats()["offload_blocks_loaded"]
        assert llm.embed([{"prompt_token_ids": A}], pooling="mean")[0].embedding == mean
        assert llm.engine.stats()["offload_blocks_loaded"] == loaded  # mean: no tier hit
        evict(llm)
        tier_hit = llm.embed([{"prompt_token_ids": A}], pooling="last")[0]
        assert llm.engine.stats()["offload_blocks_loaded"] > loaded
        assert tier_hit.embedding == pool_hit.embedding
        check_pool(llm)
    finally:
        llm.engine.shutdown()
