"""Embeddings at tp=2 (rank 0 in the driver, rank 1 a Ray actor): rank 0 pools the hidden states,
whole on every rank after the last all-reduce, and the vectors equal transformers' within the
bound of tests/engine/test_embeddings.py (twice float32's own rounding effect, measured as
transformers float32 against float64, with a floor of a few ulps). Embedding requests share the
steps of generation requests, which keep tp=1's greedy tokens: rank 1 follows the same steps
without sampling for them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import SamplingParams
from tests.workers.test_tp_correctness import TINY_ARGS
from workers import LLM

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], list(range(300, 350)), [7]]
ULP_FLOOR = 8 * 2.0**-24


def _reference(model_dir) -> dict:
    from transformers import LlamaForCausalLM

    out = {}
    for dtype in (torch.float32, torch.float64):
        hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        for p in PROMPTS:
            with torch.inference_mode():
                h = hf(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0].double()
            out.setdefault(("last", dtype), []).append(F.normalize(h[-1], dim=-1))
            out.setdefault(("mean", dtype), []).append(F.normalize(h.mean(dim=0), dim=-1))
    return out


def test_tp2_embeddings_equal_transformers_beside_generation(ray_local, tiny_llama_dir):
    ref = _reference(tiny_llama_dir)
    gen = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tp1 = LLM(str(tiny_llama_dir), **TINY_ARGS)
    try:
        expected = tp1.generate([{"prompt_token_ids": PROMPTS[0]}], gen, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        tp1.shutdown()
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **TINY_ARGS)
    try:
        for pooling in ("last", "mean"):
            effect = max(
                (a - b).abs().max().item() for a, b in zip(ref[(pooling, torch.float32)], ref[(pooling, torch.float64)])
            )
            bound = max(2 * effect, ULP_FLOOR)
            eng = llm.engine
            g = eng.add_request(None, {"prompt_token_ids": PROMPTS[0]}, gen)
            ids = [
                eng.add_request(None, {"prompt_token_ids": p}, SamplingParams(max_tokens=1, pooling=pooling))
                for p in PROMPTS
            ]
            done = {}
            while eng.has_unfinished_requests():
                done |= {o.request_id: o for o in eng.step() if o.finished}
            assert done[g].outputs[0].token_ids == expected
            for rid, want in zip(ids, ref[(pooling, torch.float64)]):
                got = torch.tensor(done[rid].embedding, dtype=torch.float64)
                assert (got - want).abs().max().item() <= bound, (pooling, rid)
        assert llm.stats()["blocks_used"] == 0
        llm.engine.core.scheduler.check_integrity()
        llm.engine.core.executor.check_health()
    finally:
        llm.shutdown()
