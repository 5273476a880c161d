"""Engine TokenLogprobs -> the OpenAI logprobs shapes (legacy completions, and chat)."""

from __future__ import annotations

import math
from typing import Callable

from engine.outputs import TokenLogprob


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf; OpenAI clients expect numbers


def completion_logprobs(
    lps: list[TokenLogprob],
    prompt_lps: list[TokenLogprob | None] | None,
    prompt_ids: list[int],
    token_str: Callable[[int], str],
    offset: int,
) -> dict:
    """`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; with echo, the prompt's
    positions come first (the first prompt token has no logprob: null)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    entries: list[tuple[int, TokenLogprob | None]] = []
    if prompt_lps is not None:
        entries += [(tid, prompt_lps[i] if i < len(prompt_lps) else None) for i, tid in enumerate(prompt_ids)]
    entries += [(lp.token_id, lp) for lp in lps]
    for tid, lp in entries:
        s = lp.decoded if lp is not None and lp.decoded is not None else token_str(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_finite(lp.logprob))
        top = {s: _finite(lp.logprob)}
        for (t, v), d in zip(lp.top, lp.top_decoded or [token_str(t) for t, _ in lp.top]):
            top.setdefault(d, _finite(v))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(lps: list[TokenLogprob] | None, token_str: Callable[[int], str]) -> dict:
    """`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}`."""
    content = []
    for lp in lps or []:
        s = lp.decoded if lp.decoded is not None else token_str(lp.token_id)
        top_dec = lp.top_decoded or [token_str(t) for t, _ in lp.top]
        content.append({**_entry(s, lp.logprob), "top_logprobs": [_entry(d, v) for (_, v), d in zip(lp.top, top_dec)]})
    return {"content": content}
