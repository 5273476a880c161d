"""Disaggregated serving end to end (real Ray, Serve and the `openai` client): outputs equal the
colocated engine's token for token (short prompts prefilled locally, long ones remotely, a
prompt whose prefix the decode replica holds moving only its missing blocks, n=2, logprobs,
stop strings, seeded sampling, a JSON schema), the transfer counters and per-pool series on /metrics, and every
block back in both pools."""

from __future__ import annotations

import asyncio

import pytest

from engine import SamplingParams, StructuredOutput
from tests.disagg.conftest import BLOCK_BYTES, LOCAL_MAX, transfer_counters, wait_pools_idle
from tests.router.conftest import metrics

pytestmark = pytest.mark.slow

DOC = (
    "The observatory on the hill kept a log of every comet it saw. Each entry named the night, the "
    "sky, the telescope and the person at the eyepiece, and the keepers argued about the spelling of "
    "the comets' names for years. "
)
SHORT = "The capital of France is"
LONG = DOC + "Summarise the log in one sentence:"


def _client(url: str):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


async def _complete(c, prompt: str, json_schema: dict | None = None, **kw):
    model = (await c.models.list()).data[0].id
    if json_schema is not None:
        kw["extra_body"] = {"structured_outputs": {"json": json_schema}}
    return await c.completions.create(model=model, prompt=prompt, **kw)


ENTRY = {
    "type": "object",
    "properties": {"night": {"type": "string", "maxLength": 20}, "comet": {"type": "string", "maxLength": 20}},
    "required": ["night", "comet"],
    "additionalProperties": False,
}
CASES = [
    ("short-greedy-logprobs", SHORT, dict(max_tokens=16, temperature=0, logprobs=2)),
    ("long-greedy-logprobs", LONG, dict(max_tokens=24, temperature=0, logprobs=2)),
    ("long-stop", LONG + " In short,", dict(max_tokens=40, temperature=0, stop=["."])),
    ("long-n2", DOC + "Two titles for it:", dict(max_tokens=16, temperature=0, n=2)),
    ("long-seeded", DOC + "A poem about it:", dict(max_tokens=24, temperature=0.9, top_p=0.9, seed=1234)),
    # The decode side holds the grammar: the prefill side only computes the prompt's KV.
    ("long-json", DOC + "The log's first entry as JSON:", dict(max_tokens=48, temperature=0, json_schema=ENTRY)),
]


def _params(kw: dict) -> SamplingParams:
    return SamplingParams(
        max_tokens=kw["max_tokens"],
        temperature=kw["temperature"],
        top_p=kw.get("top_p", 1.0),
        seed=kw.get("seed"),
        n=kw.get("n", 1),
        stop=kw.get("stop"),
        logprobs=kw.get("logprobs"),
        structured_output=StructuredOutput("json", kw["json_schema"]) if "json_schema" in kw else None,
    )


def test_outputs_equal_colocated(pd_cluster, reference_llm):
    url, handle = pd_cluster["url"], pd_cluster["handle"]
    before = transfer_counters(url)
    refs = reference_llm.generate([p for _, p, _ in CASES], [_params(kw) for _, _, kw in CASES], use_tqdm=False)

    async def run():
        c = _client(url)
        return await asyncio.gather(*(_complete(c, p, **kw) for _, p, kw in CASES))

    got = asyncio.run(run())
    for (name, _, _), ref, resp in zip(CASES, refs, got):
        assert len(resp.choices) == len(ref.outputs), name
        for choice in sorted(resp.choices, key=lambda ch: ch.index):
            want = ref.outputs[choice.index]
            assert choice.text == want.text, (name, choice.index)
            assert choice.finish_reason == want.finish_reason, name
            if want.logprobs is not None:
                for lp, w in zip(choice.logprobs.token_logprobs, want.logprobs):
                    assert lp == pytest.approx(w.logprob, abs=1e-3), name
        assert resp.usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs), name
    after = transfer_counters(url)
    remote = after["num_remote_prefills"] - before["num_remote_prefills"]
    assert remote >= 6  # five long prompts, n=2 asks once per sequence
    assert after["num_local_prefills"] - before["num_local_prefills"] >= 1  # the short one
    assert after["kv_transfers"] - before["kv_transfers"] == remote
    assert after["kv_transfer_failures"] == before["kv_transfer_failures"]
    page = metrics(url)
    assert page["orbital:pool_num_replicas{pool=prefill}"] == 1
    assert page["orbital:pool_num_replicas{pool=decode}"] == 1
    assert page["orbital:kv_transfer_seconds_count"] >= remote
    asyncio.run(wait_pools_idle(handle))


def test_only_missing_blocks_move(pd_cluster, reference_llm):
    """The decode replica holds the first prompt's blocks: the second, which extends it, moves
    only the blocks past them, and bytes = blocks x block bytes."""
    url, handle = pd_cluster["url"], pd_cluster["handle"]
    tok = reference_llm.tokenizer
    first = "Ledger B. " + DOC * 2
    second = first + "Now list every person named in the log, the nights they watched and the comets they saw:"
    a, b = tok(first)["input_ids"], tok(second)["input_ids"]
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    held, need = common // 16, -(-(len(b) - 1) // 16)
    assert len(b) - 1 - held * 16 > LOCAL_MAX  # the uncached suffix goes remote

    async def run():
        c = _client(url)
        await _complete(c, first, max_tokens=4, temperature=0)
        mid = transfer_counters(url)
        resp = await _complete(c, second, max_tokens=12, temperature=0)
        return mid, resp

    mid, resp = asyncio.run(run())
    after = transfer_counters(url)
    [ref] = reference_llm.generate([second], [SamplingParams(max_tokens=12, temperature=0)], use_tqdm=False)
    assert resp.choices[0].text == ref.outputs[0].text
    assert after["kv_transfers"] - mid["kv_transfers"] == 1
    moved = after["kv_transfer_blocks"] - mid["kv_transfer_blocks"]
    assert moved == need - held
    assert after["kv_transfer_bytes"] - mid["kv_transfer_bytes"] == moved * BLOCK_BYTES
    asyncio.run(wait_pools_idle(handle))


def test_disconnect_during_remote_prefill_frees_both_pools(pd_cluster):
    """A client that hangs up while its prompt is being prefilled remotely (and one that hangs
    up after its first token): both pools get every block back."""
    import httpx

    url, handle = pd_cluster["url"], pd_cluster["handle"]
    model = "SmolLM2-135M-Instruct"

    async def hang_up(after_chunks: int, i: int) -> None:
        body = {"model": model, "prompt": f"Copy {i}. " + DOC * 3, "max_tokens": 64, "stream": True}
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                n = 0
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        n += 1
                    if n >= after_chunks:
                        break

    async def run():
        await asyncio.gather(*(hang_up(0 if i % 2 == 0 else 1, i) for i in range(4)))
        return await wait_pools_idle(handle)

    asyncio.run(run())
