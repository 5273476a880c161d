"""The requests the failover tests send, through the `openai` client: greedy and seeded (the
seeded stream watermarked too), streamed and not, `ignore_eos` so each runs its whole token
budget."""

from __future__ import annotations

from typing import Awaitable, Callable

from tests.failover.conftest import MAX_TOKENS

SPECS = [
    {"name": "greedy-stream", "temperature": 0.0, "stream": True},
    {"name": "seeded-stream", "temperature": 1.0, "top_p": 0.95, "seed": 17, "stream": True, "watermark": True},
    {"name": "greedy", "temperature": 0.0, "stream": False},
    {"name": "seeded", "temperature": 0.9, "seed": 23, "stream": False},
]

OnChunk = Callable[[str, int], Awaitable[None]]


def client(url: str):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


async def complete(c, prompt: str, spec: dict, on_chunk: OnChunk | None = None) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens); `on_chunk(request id, tokens so far)` on each
    streamed chunk that carries a choice. Tokens, not chunks: a chunk carries every token the
    engine made since the last one the client read (a slow client gets fewer, larger chunks), so
    the count comes from the chunk's logprobs (one entry per token)."""
    kw = {
        "model": (await c.models.list()).data[0].id,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": spec["temperature"],
        "extra_body": {"ignore_eos": True, **({"watermark": True} if spec.get("watermark") else {})},
    }
    for k in ("seed", "top_p"):
        if k in spec:
            kw[k] = spec[k]
    if not spec["stream"]:
        r = await c.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    stream = await c.completions.create(stream=True, stream_options={"include_usage": True}, logprobs=0, **kw)
    text, finish, tokens, so_far = "", None, None, 0
    async for ch in stream:
        if ch.usage is not None:
            tokens = ch.usage.completion_tokens
        for choice in ch.choices:
            text += choice.text
            finish = choice.finish_reason or finish
            so_far += len(choice.logprobs.tokens) if choice.logprobs and choice.logprobs.tokens else 0
            if on_chunk is not None:
                await on_chunk(ch.id, so_far)
    return text, finish, tokens
