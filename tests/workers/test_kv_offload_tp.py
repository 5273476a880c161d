"""The offload tier at tp=2: each rank saves and loads its own KV heads (one file per rank), the
outputs equal tp=1's, and a load that fails on one rank only is recomputed on both."""

from __future__ import annotations

import glob
import os

import pytest

from engine import LLM as EngineLLM
from engine import SamplingParams
from workers import LLM

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

BS = 4
BLOCK_BYTES = 2 * 2 * 4 * BS * 8 * 4  # the whole replica's: layers x K/V x 4 KV heads x block x head_dim x float32
A = [(7 * i + 3) % 500 for i in range(29)]  # 7 full blocks hit, then one token computed
OTHERS = [[(11 * i + 5 + 97 * k) % 500 for i in range(30)] for k in range(3)]
PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
ARGS = dict(
    dtype="float32",
    block_size=BS,
    num_blocks=16,
    max_num_batched_tokens=64,
    num_threads=1,
    kv_offload_bytes=64 * BLOCK_BYTES,
)


def gen(llm, prompt):
    [o] = llm.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)
    c = o.outputs[0]
    return c.token_ids, [(lp.logprob, lp.top) for lp in c.logprobs], o.num_cached_tokens


def round_trip(llm) -> tuple:
    """First run, a pool hit, then the pool turned over and A again (from the tier)."""
    first, pool_hit = gen(llm, A), gen(llm, A)
    for p in OTHERS:
        gen(llm, p)
    return first, pool_hit, gen(llm, A)


def test_tp2_saves_and_loads_each_rank_s_shard(ray_local, tiny_llama_dir, tmp_path):
    tp1 = EngineLLM(str(tiny_llama_dir), **ARGS)
    try:
        ref = round_trip(tp1)
    finally:
        tp1.shutdown()
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, kv_offload_dir=str(tmp_path), **ARGS)
    try:
        files = {r: glob.glob(str(tmp_path / f"rank{r}-*.kv")) for r in (0, 1)}
        assert all(len(f) == 1 for f in files.values()), files
        ex = llm.engine.core.executor
        assert ex.num_offload_slots == 64 and ex.rank0.runner.offload.block_nbytes == BLOCK_BYTES // 2
        first, pool_hit, tier_hit = round_trip(llm)
        assert tier_hit[:2] == pool_hit[:2] and tier_hit[2] == 28  # the same KV bytes on both ranks
        for got, want in zip((first, pool_hit, tier_hit), ref):
            assert got[0] == want[0] and got[2] == want[2]
            assert max(abs(a[0] - b[0]) for a, b in zip(got[1], want[1])) < 1e-4
        st = llm.stats()
        assert st["prefix_cache_hits_offload"] == 28 and st["offload_load_failures"] == 0
        # Rank 1's file only: every slot's bytes flipped. Its loads fail, so both ranks recompute.
        for p in OTHERS:
            gen(llm, p)
        store = ex.rank0.runner.offload
        with open(files[1][0], "r+b") as f:
            for slot in range(store.num_slots):
                f.seek(slot * store.stride + 64 + 7)
                f.write(os.urandom(8))
        again = gen(llm, A)
        assert again[0] == first[0] and again[2] == 0
        assert again[1] == first[1]  # recomputed as the first run was: bit for bit
        st = llm.stats()
        assert st["offload_load_failures"] == 7 and st["blocks_used"] == 0
        llm.engine.core.scheduler.check_integrity()
    finally:
        llm.shutdown()
    assert os.listdir(tmp_path) == []  # every rank removed its file
