"""A GPTQ act-order checkpoint under tensor parallelism: column-parallel weights keep their
int4 groups and input order; a row-parallel shard, whose inputs cut groups, is its exact float
values. tp=2 computes what tp=1 computes on the same checkpoint."""

from __future__ import annotations

from engine import SamplingParams
from tests.engine.gptq_awq_writer import write_quantized
from tests.tiny_llama import save_tiny_llama
from workers import LLM

PROMPTS = [[5, 17, 300, 201, 77], [100 + i for i in range(40)]]
ARGS = dict(dtype="float32", block_size=8, num_blocks=64, num_threads=1)


def _run(path, tp):
    llm = LLM(str(path), tensor_parallel_size=tp, **ARGS)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(temperature=0, max_tokens=8, logprobs=0),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def test_gptq_act_order_at_tp2_matches_tp1(tmp_path, smollm_dir, ray_local):
    save_tiny_llama(tmp_path / "f", tokenizer_from=smollm_dir, hidden_size=128, intermediate_size=256)
    write_quantized(tmp_path / "f", tmp_path / "q", tmp_path / "ref", method="gptq", desc_act=True)
    one, two = _run(tmp_path / "q", 1), _run(tmp_path / "q", 2)
    for (ids1, lp1), (ids2, lp2) in zip(one, two):
        assert ids1 == ids2
        assert max(abs(a - b) for a, b in zip(lp1, lp2)) < 1e-3
