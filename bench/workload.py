"""A seeded mixed workload for the static-vs-continuous batching experiment (token ids)."""
from __future__ import annotations

import random
from dataclasses import dataclass

_WORDS = ("the of and to in is was for on that with as by at from his her they this which be are an "
          "system river model data city light music garden engine market story science water energy "
          "history language computer planet ocean forest mountain network teacher student window").split()


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def mixed_workload(tokenizer, n: int, seed: int = 0, prompt_range=(20, 600), output_range=(10, 500)) -> list[BenchRequest]:
    rng = random.Random(seed)
    text = " ".join(rng.choice(_WORDS) for _ in range(prompt_range[1] * 2))
    pool = tokenizer(text, add_special_tokens=False).input_ids
    out = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        start = rng.randint(0, len(pool) - plen)
        out.append(BenchRequest(pool[start : start + plen], rng.randint(*output_range)))
    return out
