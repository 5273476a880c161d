"""Embeddings from a decoder model (engine/runner/pooling.py): `last` and `mean` pooled, normalised
vectors equal transformers' final hidden states pooled the same way; embedding requests run in the
same batches as generation without changing its tokens; a prefix-cache hit gives the same vector;
every KV block returns to the pool.

Tolerance: both sides compute in float32 and differ only in the order of their sums. The bound is
twice float32's own rounding effect on these prompts, measured as transformers in float32 against
transformers in float64 (each path lies within that effect of the exact vector, so two paths lie
within twice it; tests/engine/path_agreement.py makes the same argument), with a floor of a few
float32 ulps of a unit vector's largest entries."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError, PromptTooLongError
from tests.tiny_llama import save_tiny_llama

PROMPTS = [[5, 17, 300, 2, 77], [100 + i for i in range(40)], [42] * 3, list(range(7, 7 + 90, 3)), [9]]
ULP_FLOOR = 8 * 2.0**-24  # a few float32 ulps at 1.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_dir):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-embed"), seed=3, tokenizer_from=smollm_dir)


@pytest.fixture(scope="module")
def reference(tiny):
    """{(pooling, dtype): [vector per prompt]} from transformers' final hidden states
    (`output_hidden_states[-1]`, after the final norm in HF Llama), in float32 and float64."""
    from transformers import LlamaForCausalLM

    out = {}
    for dtype in (torch.float32, torch.float64):
        hf = LlamaForCausalLM.from_pretrained(tiny, dtype=dtype).eval()
        for p in PROMPTS:
            with torch.inference_mode():
                h = hf(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0].double()
            out.setdefault(("last", dtype), []).append(F.normalize(h[-1], dim=-1))
            out.setdefault(("mean", dtype), []).append(F.normalize(h.mean(dim=0), dim=-1))
    return out


def _bound(reference, pooling: str) -> float:
    effect = max(
        (a - b).abs().max().item()
        for a, b in zip(reference[(pooling, torch.float32)], reference[(pooling, torch.float64)])
    )
    return max(2 * effect, ULP_FLOOR)


def _llm(path, **kw) -> LLM:
    # Chunks of at most 24 tokens: the 40- and 30-token prompts are pooled over several steps.
    return LLM(str(path), dtype="float32", num_blocks=64, block_size=8, max_num_batched_tokens=24, num_threads=1, **kw)


def _assert_pool_whole(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    llm.engine.core.scheduler.check_integrity()


def _diff(got: list[float], want: torch.Tensor) -> float:
    return (torch.tensor(got, dtype=torch.float64) - want).abs().max().item()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_embeddings_equal_transformers(tiny, reference, pooling):
    llm = _llm(tiny, pooling_type=pooling)
    try:
        outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS])
        bound = _bound(reference, pooling)
        for out, p, want in zip(outs, PROMPTS, reference[(pooling, torch.float64)], strict=True):
            assert out.prompt_token_ids == p and len(out.embedding) == 64
            assert abs(sum(v * v for v in out.embedding) - 1) < 1e-5
            assert _diff(out.embedding, want) <= bound, (pooling, len(p), _diff(out.embedding, want), bound)
        other = "mean" if pooling == "last" else "last"
        assert _diff(outs[1].embedding, reference[(other, torch.float64)][1]) > 100 * bound  # the mode matters
        # The per-call choice overrides the engine's default.
        (again,) = llm.embed([PROMPTS[1]], pooling=other)
        assert _diff(again.embedding, reference[(other, torch.float64)][1]) <= _bound(reference, other)
        _assert_pool_whole(llm)
    finally:
        llm.shutdown()


def test_embeddings_batch_with_generation_without_changing_it(tiny, reference):
    gen = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    gen_prompts = [[11, 12, 13, 14, 15, 16], [400, 3, 200]]
    alone = _llm(tiny)
    try:
        expected = [o.outputs[0].token_ids for o in alone.generate(gen_prompts, gen, use_tqdm=False)]
    finally:
        alone.shutdown()
    llm = _llm(tiny, pooling_type="mean")
    try:
        eng = llm.engine
        gen_ids = [eng.add_request(None, p, gen) for p in gen_prompts]
        emb_ids = [eng.add_request(None, p, SamplingParams(max_tokens=1, pooling="mean")) for p in PROMPTS[:3]]
        done, first = {}, eng.step()
        # One step ran both kinds: the short prompts' vectors and the generations' first tokens.
        assert any(o.embedding is not None for o in first) and any(o.outputs[0].token_ids for o in first)
        for o in first + [o for _ in range(200) if eng.has_unfinished_requests() for o in eng.step()]:
            if o.finished:
                done[o.request_id] = o
        assert [done[r].outputs[0].token_ids for r in gen_ids] == expected
        bound = _bound(reference, "mean")
        for r, want in zip(emb_ids, reference[("mean", torch.float64)]):
            assert done[r].outputs[0].token_ids == [] and done[r].outputs[0].finish_reason == "stop"
            assert _diff(done[r].embedding, want) <= bound
        assert all(done[r].embedding is None for r in gen_ids)
        _assert_pool_whole(llm)
    finally:
        llm.shutdown()


def test_a_prefix_cache_hit_gives_the_same_embedding(tiny, reference):
    """`last` pooling takes prefix-cache hits (only the last token is computed again); `mean`
    needs every position's hidden state, so like prompt logprobs it takes none."""
    llm = _llm(tiny)
    try:
        prompt = PROMPTS[1]  # 40 tokens: 4 full blocks of 8 and a tail hit; the last token never
        first, second = llm.embed([prompt]), llm.embed([prompt])
        assert first[0].num_cached_tokens == 0 and second[0].num_cached_tokens == 39
        bound = _bound(reference, "last")
        for out in (first[0], second[0]):
            assert _diff(out.embedding, reference[("last", torch.float64)][1]) <= bound
        mean = llm.embed([prompt, prompt], pooling="mean")
        assert [m.num_cached_tokens for m in mean] == [0, 0]
        assert _diff(mean[1].embedding, reference[("mean", torch.float64)][1]) <= _bound(reference, "mean")
        _assert_pool_whole(llm)
        assert llm.stats()["blocks_cached"] > 0  # the embeddings' full blocks stay in the prefix cache
    finally:
        llm.shutdown()


def test_bad_embedding_requests_are_refused(tiny):
    with pytest.raises(InvalidRequestError, match="pooling"):
        SamplingParams(pooling="max")
    with pytest.raises(InvalidRequestError, match="pooling"):
        SamplingParams(pooling="last", n=2)
    with pytest.raises(InvalidRequestError, match="pooling_type"):
        _llm(tiny, pooling_type="cls")
    llm = _llm(tiny, max_model_len=32)
    try:
        (whole,) = llm.embed([list(range(1, 33))])  # an embedding may fill the whole context
        assert len(whole.embedding) == 64
        with pytest.raises(PromptTooLongError):
            llm.embed([list(range(1, 34))])
        with pytest.raises(InvalidRequestError):
            llm.embed([[]])
        _assert_pool_whole(llm)
    finally:
        llm.shutdown()


def test_the_async_engine_embeds_on_both_of_its_paths(tiny, reference):
    """`AsyncEngine.embed` (text side) and `generate_tokens` with `pooling` set (the serving
    path: token ids in, the vector on the finishing `EngineCoreOutput`) give the same vector."""
    import asyncio

    from engine.async_engine import AsyncEngine
    from engine.engine_args import EngineArgs

    eng = AsyncEngine(
        EngineArgs(str(tiny), dtype="float32", num_blocks=64, block_size=8, max_num_batched_tokens=24, num_threads=1)
    )

    async def both():
        whole = await eng.embed({"prompt_token_ids": PROMPTS[3]})
        outs = [o async for o in eng.generate_tokens("t-1", PROMPTS[3], SamplingParams(max_tokens=1, pooling="last"))]
        return whole, outs

    try:
        whole, outs = asyncio.run(both())
        assert outs[-1].finished and outs[-1].new_token_ids == [] and all(o.embedding is None for o in outs[:-1])
        assert _diff(whole.embedding, reference[("last", torch.float64)][3]) <= _bound(reference, "last")
        assert _diff(outs[-1].embedding, reference[("last", torch.float64)][3]) <= _bound(reference, "last")
        assert eng.stats()["blocks_used"] == 0
    finally:
        eng.shutdown()


def test_the_engine_cli_prints_embeddings(chat_stand_in, capsys):
    """`python -m engine --embed`: one JSON line per prompt, the vectors `LLM.embed` returns (the
    chat stand-in: text prompts need the embedded model's vocabulary)."""
    import json

    from engine.cli import main

    argv = ["--model", chat_stand_in, "--embed", "--pooling-type", "mean", "--dtype", "float32", "--threads", "1"]
    assert main([*argv, "--prompt", "hello", "--prompt", "world"]) == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.strip().splitlines()[-2:]]
    assert [ln["prompt"] for ln in lines] == ["hello", "world"]
    llm = LLM(chat_stand_in, dtype="float32", num_threads=1, pooling_type="mean")
    try:
        want = llm.embed(["hello", "world"])
    finally:
        llm.shutdown()
    for ln, w in zip(lines, want):
        assert ln["num_tokens"] == len(w.prompt_token_ids) and len(ln["embedding"]) == 96
        assert _diff(ln["embedding"], torch.tensor(w.embedding, dtype=torch.float64)) <= ULP_FLOOR
