"""Small steps leave a core (engine/step_threads.py): which steps run on fewer threads, and that
the tokens and logprobs do not depend on it."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.step_threads import StepThreads

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.mark.parametrize(
    ("full", "max_tokens", "num_tokens", "expected"),
    [(2, 4, 1, 1), (2, 4, 4, 1), (2, 4, 5, 2), (8, 4, 3, 7), (1, 4, 1, 1), (2, 0, 1, 2)],
)
def test_threads_for(full: int, max_tokens: int, num_tokens: int, expected: int) -> None:
    assert StepThreads(full, max_tokens).threads_for(num_tokens) == expected


def run(spare: int) -> tuple[list, list[tuple[int, int]]]:
    torch.set_num_threads(2)
    llm = LLM(dtype="float32", num_threads=2, spare_core_max_tokens=spare, kv_cache_memory_bytes=64 << 20)
    seen: list[tuple[int, int]] = []  # (tokens in the step, threads it ran on)
    model = llm.engine.core.executor.runner.model
    model.register_forward_pre_hook(lambda _m, args: seen.append((args[0].shape[0], torch.get_num_threads())))
    sp = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    one = llm.generate(PROMPTS[:1], sp, use_tqdm=False)  # alone: a prompt step, then 1-row decodes
    batch = llm.generate(PROMPTS * 2, sp, use_tqdm=False)  # 6 rows a step: every core
    outs = [(o.outputs[0].token_ids, [lp.top for lp in o.outputs[0].logprobs]) for o in one + batch]
    return outs, seen


def test_small_steps_leave_a_core_and_keep_the_tokens() -> None:
    try:
        spared, seen = run(4)
        plain, seen_plain = run(0)
    finally:
        torch.set_num_threads(2)
    assert all(t == 2 for _, t in seen_plain)
    assert any(n == 1 and t == 1 for n, t in seen), seen  # one-row decodes ran on one thread
    assert all(t == (1 if n <= 4 else 2) for n, t in seen), seen  # prompt steps and 6-row decodes on two
    assert any(n > 4 for n, _ in seen)
    for (ids, lps), (ids0, lps0) in zip(spared, plain):
        assert ids == ids0
        for a, b in zip(lps, lps0):
            assert [k for k, _ in a] == [k for k, _ in b]
            assert [v for _, v in a] == pytest.approx([v for _, v in b], abs=1e-4)
