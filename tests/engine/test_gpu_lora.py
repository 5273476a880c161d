"""Multi-LoRA on CUDA (engine/lora/): four random peft adapters of different ranks and targets and
the base model in one batch, greedy tokens and logprobs against transformers + peft on the same
GPU in float32 (PyTorch's forms: the C++ per-row op is CPU only)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.lora.request import LoRARequest
from tests.engine.hf_reference import hf_greedy
from tests.engine.lora_models import ADAPTERS, load_base, save_adapter, save_tiny_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[5, 17, 300, 2048, 77], [1000 + i for i in range(40)], list(range(7, 7 + 60, 3))]
MAX_TOKENS = 12


@pytest.mark.parametrize("max_num_batched_tokens", [48, 512])  # prefill chunks beside decode rows; whole prompts
def test_mixed_batch_matches_peft_on_cuda(tmp_path, smollm_tokenizer, max_num_batched_tokens):
    base_dir = tmp_path / "base"
    save_tiny_llama(base_dir, smollm_tokenizer)
    refs = {None: load_base(base_dir)}
    paths = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        paths[name] = tmp_path / name
        refs[name] = save_adapter(base_dir, paths[name], seed=i + 1, **kw)
    expected = {name: [hf_greedy(m.to("cuda"), p, MAX_TOKENS, None) for p in PROMPTS] for name, m in refs.items()}
    llm = LLM(
        str(base_dir),
        dtype="float32",
        device="cuda",
        enable_lora=True,
        max_loras=len(ADAPTERS),
        max_lora_rank=8,
        kv_cache_memory_bytes=64 << 20,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    try:
        loras = {name: LoRARequest(name, i + 1, str(paths[name])) for i, name in enumerate(ADAPTERS)}
        order = [(name, j) for j in range(len(PROMPTS)) for name in [*ADAPTERS, None]]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
        outs = llm.generate(
            [{"prompt_token_ids": PROMPTS[j]} for _, j in order],
            params,
            use_tqdm=False,
            lora_request=[loras.get(name) for name, _ in order],
        )
        for out, (name, j) in zip(outs, order):
            ids, lps = expected[name][j]
            assert out.outputs[0].token_ids == ids, (name, j)
            got = [lp.logprob for lp in out.outputs[0].logprobs]
            assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-3  # the contract's bound
        assert llm.stats()["blocks_used"] == 0
    finally:
        llm.shutdown()
