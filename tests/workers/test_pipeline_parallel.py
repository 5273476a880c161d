"""Pipeline parallelism on several simulated nodes (ray.cluster_utils.Cluster, gloo): the layers
split into stages, each stage a tensor-parallel group on a node of its own. Greedy tokens equal
transformers' float32 ones and the pp=1 engine's, logprobs within 1e-3 (even and uneven
partitions, tp=1 and tp=2 per stage, Llama and Gemma 2); concurrent requests keep several
micro-batches in the pipe; the KV hand-off reads and writes every stage's layers; a killed
stage rank ends generation with an error naming its stage."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from engine import EngineDeadError, SamplingParams
from engine.errors import InvalidRequestError
from tests.serve_cluster import simulated_nodes
from tests.tiny_llama import save_tiny_llama
from tests.workers.conftest import hf_greedy
from tests.workers.test_tp_correctness import PROMPTS
from workers import LLM

pytestmark = pytest.mark.slow

ARGS = dict(
    dtype="float32", block_size=4, num_blocks=128, max_num_batched_tokens=16, enable_prefix_caching=True, num_threads=1
)
NEW = 10


@pytest.fixture(scope="module")
def three_nodes():
    """The driver's node (head) and two more, 2 CPUs each: room for a stage of tp=2 on each."""
    with simulated_nodes(2, [{"num_cpus": 2}] * 2) as cluster_and_nodes:
        yield cluster_and_nodes


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory, smollm_dir):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-4l"), seed=3, tokenizer_from=smollm_dir, num_hidden_layers=4)


@pytest.fixture(scope="module")
def reference(four_layers):
    return hf_greedy(four_layers, PROMPTS, NEW)


def _generate(llm: LLM, prompts=PROMPTS, new=NEW):
    params = SamplingParams(temperature=0, max_tokens=new, logprobs=0)
    # The first prompt and the shared prefix first: later prompts hit the prefix cache.
    first = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[4:]], params, use_tqdm=False) if prompts[4:] else []
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in first + rest]


def _assert_same(got, expected, tol=1e-3):
    for k, ((ids, lps), (exp_ids, exp_lps)) in enumerate(zip(got, expected)):
        assert ids == exp_ids, f"prompt {k}: {ids} != {exp_ids}"
        assert max(abs(a - b) for a, b in zip(lps, exp_lps)) < tol, f"prompt {k}: logprobs differ"


@pytest.mark.parametrize(
    "pp,tp,partition",
    [(2, 1, None), (2, 2, None), (3, 1, "1,2,1")],
    ids=["pp2-tp1", "pp2-tp2", "pp3-uneven"],
)
def test_stages_match_transformers_on_separate_nodes(three_nodes, four_layers, reference, pp, tp, partition):
    llm = LLM(
        str(four_layers), tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_partition=partition, **ARGS
    )
    try:
        ex = llm.engine.core.executor
        info = ex.worker_info()
        assert [i["rank"] for i in info] == list(range(pp * tp))
        nodes_of = [{i["node_id"] for i in info if i["stage"] == s} for s in range(pp)]
        assert all(len(n) == 1 for n in nodes_of), f"a stage spans nodes: {nodes_of}"
        assert len(set.union(*nodes_of)) == pp, f"stages share a node: {nodes_of}"
        # Each stage's KV cache holds its own layers only.
        layers = [len(r) for r in ex.stage_layers]
        assert layers == ([int(x) for x in partition.split(",")] if partition else [4 // pp] * pp)
        _assert_same(_generate(llm), reference)
    finally:
        llm.shutdown()


def test_pp1_engine_agrees(four_layers, reference):
    """The in-process engine on the same model: what the stages are compared with above."""
    from engine import LLM as LocalLLM

    llm = LocalLLM(str(four_layers), **ARGS)
    try:
        _assert_same(_generate(llm), reference)
    finally:
        llm.shutdown()


def test_micro_batches_overlap(three_nodes, four_layers, reference):
    """Many concurrent requests: the engine keeps up to pp steps in the pipe (the executor's own
    counters), and the tokens are still the reference's."""
    llm = LLM(str(four_layers), pipeline_parallel_size=2, **{**ARGS, "max_num_seqs": 3})
    try:
        ex = llm.engine.core.executor
        assert ex.max_concurrent_batches == 2
        got = _generate(llm, PROMPTS * 2)
        _assert_same(got, reference * 2)
        assert ex.max_in_flight == 2, f"at most {ex.max_in_flight} step(s) in the pipe"
        assert ex.in_flight == 0
        pool = llm.engine.core.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == ex.num_blocks
    finally:
        llm.shutdown()


def test_preemption_under_a_small_pool(three_nodes, four_layers, reference):
    """A pool too small for every request at once: preempted requests are recomputed across
    both stages and still give the reference tokens."""
    llm = LLM(str(four_layers), pipeline_parallel_size=2, **{**ARGS, "num_blocks": 24})
    try:
        got = _generate(llm, PROMPTS * 2)
        stats = llm.stats()
    finally:
        llm.shutdown()
    _assert_same(got, reference * 2)
    assert stats["num_preemptions"] > 0, stats


def test_kv_handoff_covers_every_stage(three_nodes, four_layers):
    """Blocks read from a pp=2 engine equal the pp=1 engine's for the same prompt (every layer,
    every head), and written back into the pp=2 engine they read the same again."""
    from engine import LLM as LocalLLM

    prompt = list(range(200, 232))  # 8 full blocks
    params = SamplingParams(temperature=0, max_tokens=1)
    one = LocalLLM(str(four_layers), **ARGS)
    two = LLM(str(four_layers), pipeline_parallel_size=2, **ARGS)
    try:
        ids = []
        for llm in (one, two):
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            pool = llm.engine.core.scheduler.kv_cache_manager.block_pool
            ids.append(sorted(b.block_id for b in pool.blocks if b.block_hash is not None))
        assert len(ids[0]) == 8 and ids[0] == ids[1]
        a = one.engine.core.executor.read_kv_blocks(ids[0])
        b = two.engine.core.executor.read_kv_blocks(ids[1])
        assert a.shape == b.shape and a.shape[0] == 4
        assert (a - b).abs().max().item() < 1e-5
        two.engine.core.executor.write_kv_blocks([100, 101], a[:, :, :, :2].contiguous())
        back = two.engine.core.executor.read_kv_blocks([100, 101])
        assert back.equal(a[:, :, :, :2])
    finally:
        one.shutdown()
        two.shutdown()


def test_killed_stage_rank_names_its_stage(three_nodes, four_layers):
    llm = LLM(str(four_layers), pipeline_parallel_size=2, **{**ARGS, "num_blocks": 512})
    ex = llm.engine.core.executor

    def killer():
        while llm.engine.core.scheduler.num_steps < 10:
            time.sleep(0.005)
        ray.kill(ex.workers[0])  # rank 1: the last stage, which samples

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineDeadError) as err:
            llm.generate(
                [{"prompt_token_ids": [1, 2, 3]}] * 4, SamplingParams(temperature=0, max_tokens=400), use_tqdm=False
            )
        assert time.monotonic() - t0 < 60
        assert "rank 1 of 2 (pipeline stage 1)" in str(err.value)
    finally:
        th.join()
        llm.shutdown()


def test_refused_settings(four_layers):
    with pytest.raises(InvalidRequestError, match="pipeline_partition"):
        LLM(str(four_layers), pipeline_parallel_size=2, pipeline_partition="1,1", **ARGS)
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        LLM(str(four_layers), pipeline_parallel_size=2, enable_lora=True, **ARGS)
    with pytest.raises(InvalidRequestError, match="at least 5 layers"):
        LLM(str(four_layers), pipeline_parallel_size=5, **ARGS)


def test_gemma2_stages_match_one(three_nodes, tmp_path, smollm_dir):
    """Gemma 2 hands on its hidden state alone (its residual adds sit inside each layer); a tied
    head on the last stage keeps the embedding there; its soft caps run on the last stage."""
    from engine import LLM as LocalLLM
    from tests.tiny_architectures import save_tiny

    save_tiny("gemma2", tmp_path, tokenizer_from=smollm_dir, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    args = {**ARGS, "max_model_len": 128}
    one = LocalLLM(str(tmp_path), **args)
    try:
        expected = _generate(one, PROMPTS[:3])
    finally:
        one.shutdown()
    two = LLM(str(tmp_path), pipeline_parallel_size=2, **args)
    try:
        _assert_same(_generate(two, PROMPTS[:3]), expected)
    finally:
        two.shutdown()
