"""A GPTQ act-order checkpoint under tensor parallelism: column-parallel weights keep their
int4 groups and input order; a row-parallel shard, whose inputs cut groups, is its exact float
values. tp=2 computes what tp=1 computes on the same checkpoint, within the path-agreement rule
(tests/engine/path_agreement.py): the two paths differ where the int4 layout rounds (its scales
and minimums are stored in bf16) and a row-parallel shard does not, so the bound is twice that
rounding's measured effect (tp=1 on the checkpoint against tp=1 on its exact float values)."""

from __future__ import annotations

from engine import SamplingParams
from tests.engine.gptq_awq_writer import write_quantized
from tests.engine.path_agreement import assert_paths_agree, rounding_bound
from tests.tiny_llama import save_tiny_llama
from workers import LLM

PROMPTS = [[5, 17, 300, 201, 77], [100 + i for i in range(40)]]
ARGS = dict(dtype="float32", block_size=8, num_blocks=64, num_threads=1)


def _run(path, tp):
    llm = LLM(str(path), tensor_parallel_size=tp, **ARGS)
    try:
        return llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(temperature=0, max_tokens=8, logprobs=2),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()


def test_gptq_act_order_at_tp2_matches_tp1(tmp_path, smollm_dir, ray_local):
    save_tiny_llama(tmp_path / "f", tokenizer_from=smollm_dir, hidden_size=128, intermediate_size=256)
    write_quantized(tmp_path / "f", tmp_path / "q", tmp_path / "ref", method="gptq", desc_act=True)
    one = _run(tmp_path / "q", 1)
    bound = rounding_bound(one, _run(tmp_path / "ref", 1))
    print(f"int4 layout rounding bound: {bound:.2e}")
    assert_paths_agree(_run(tmp_path / "q", 2), one, bound)
