"""Multi-LoRA at tp=2 (engine/lora/layer.py): A/B sharded as the base layers are (B by output rows
in the column-parallel q/k/v and gate/up, A by input columns in the row-parallel o and down, the
partial delta summed by the all-reduce). Three random peft adapters and the base model in one
batch give transformers + peft's float32 greedy tokens and logprobs, also with one KV head
replicated on both ranks."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.lora.request import LoRARequest
from tests.engine.hf_reference import hf_greedy
from tests.engine.lora_models import ADAPTERS, load_base, save_adapter, save_tiny_llama
from workers import LLM

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 300, 201, 77], [100 + i for i in range(40)]]


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_mixed_adapters_at_tp2_match_peft(kv_heads, tmp_path, smollm_tokenizer, ray_local):
    base_dir = tmp_path / "base"
    save_tiny_llama(base_dir, smollm_tokenizer, num_key_value_heads=kv_heads)
    refs = {None: load_base(base_dir)}
    loras = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        refs[name] = save_adapter(base_dir, tmp_path / name, seed=i + 1, **kw)
        loras[name] = LoRARequest(name, i + 1, str(tmp_path / name))
    order = [(name, p) for p in PROMPTS for name in [*ADAPTERS, None]]
    expected = [hf_greedy(refs[name], p, 10, None) for name, p in order]
    llm = LLM(
        str(base_dir), tensor_parallel_size=2, dtype="float32", block_size=8, num_blocks=64, max_num_batched_tokens=32,
        num_threads=1, enable_lora=True, max_loras=len(ADAPTERS), max_lora_rank=8,
    )  # fmt: skip
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for _, p in order],
            SamplingParams(temperature=0, max_tokens=10, logprobs=0, ignore_eos=True),
            use_tqdm=False,
            lora_request=[loras.get(name) for name, _ in order],
        )
    finally:
        llm.shutdown()
    for (name, _), out, (ids, lps) in zip(order, outs, expected):
        assert out.outputs[0].token_ids == ids, name
        got = [lp.logprob for lp in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-3, name
