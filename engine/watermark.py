"""Watermarked generation and its detector (Kirchenbauer et al. 2023, "A Watermark for Large
Language Models"; TGI's `watermark` parameter).

At each sampled position a pseudorandom "green list" of `gamma` x vocabulary tokens, keyed by
the deployment's secret and the previous token, gets `delta` added to its logits before
temperature, top-k/p and the draw. A reader with the key counts how many of a text's tokens are
green given their predecessor: about `gamma` of them in ordinary text, far more in watermarked
text; the z-score of that count says which.

Green lists come from a hash of (key, previous token, token) rather than a generator seeded per
position (TGI draws a permutation of the vocabulary per step): the same list, batched as tensor
ops for a step's rows, and the detector needs one hash per token. The list depends only on the
previous token, so batching, preemption, speculative decoding (each draft position is scored with
its own predecessor), tensor parallelism (rank 0 samples) and a moved request all see the same one.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import TypeVar

from engine.errors import InvalidRequestError

_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2^27: a product with a 32-bit value stays inside int64


@dataclass(frozen=True)
class Watermark:
    """`key`: the deployment's secret (a non-negative integer below 2^32); `gamma`: the green
    share of the vocabulary; `delta`: the logit bonus of green tokens (TGI's defaults)."""

    key: int
    gamma: float = 0.5
    delta: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.key, bool) or not isinstance(self.key, int) or not 0 <= self.key <= _M32:
            raise InvalidRequestError("watermark key must be an integer in [0, 2^32)", param="watermark")
        if not 0.0 < self.gamma < 1.0:
            raise InvalidRequestError(f"watermark gamma must be in (0, 1), got {self.gamma}", param="watermark")
        if not (math.isfinite(self.delta) and self.delta >= 0.0):
            raise InvalidRequestError(f"watermark delta must be a finite number >= 0, got {self.delta}", "watermark")


Ints = TypeVar("Ints")  # a Python int or an int64 tensor


def mix32(x: Ints) -> Ints:
    """A 32-bit integer hash (two multiply-xorshift rounds) of values in [0, 2^32): the same
    arithmetic on Python ints (the detector, in a router replica without torch) and on int64
    tensors (the sampler's batched green lists, engine/layers/watermark_mask.py); products stay
    below 2^59, so neither overflows."""
    x = ((x >> 16) ^ x) * _MIX & _M32
    x = ((x >> 16) ^ x) * _MIX & _M32
    return (x >> 16) ^ x


def green_seed(key: Ints, prev: Ints) -> Ints:
    """The seed of the green list that follows token `prev` under `key`."""
    return mix32((key ^ mix32(prev & _M32)) & _M32)


def green_hash(seed: Ints, token: Ints) -> Ints:
    """A token is green where this is below green_bound(gamma)."""
    return mix32((seed ^ token) & _M32)


def green_bound(gamma: float) -> float:
    return gamma * 2.0**32


def is_green(prev: list[int], tokens: list[int], wm: Watermark) -> list[bool]:
    """Whether each token is in its predecessor's green list (the detector's side)."""
    bound = green_bound(wm.gamma)
    return [green_hash(green_seed(wm.key, p), t) < bound for p, t in zip(prev, tokens)]


@dataclass
class Detection:
    num_tokens: int  # tokens scored (every token after the first)
    num_green: int
    z_score: float
    p_value: float  # one-sided: the chance ordinary text scores this high

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("num_tokens", "num_green", "z_score", "p_value")}


def detect(token_ids: list[int], wm: Watermark) -> Detection:
    """Score a text's token ids: each token after the first against its predecessor's green list.
    z = (green - gamma T) / sqrt(T gamma (1 - gamma)); p from the normal tail."""
    t = len(token_ids) - 1
    if t < 1:
        return Detection(max(t, 0), 0, 0.0, 1.0)
    green = sum(is_green(token_ids[:-1], token_ids[1:], wm))
    z = (green - wm.gamma * t) / math.sqrt(t * wm.gamma * (1 - wm.gamma))
    return Detection(t, green, z, 0.5 * math.erfc(z / math.sqrt(2)))


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.watermark detect --text "..." --key K [--model DIR]`: the z-score and
    p-value of a text under the embedded (or given) model's tokenizer."""
    p = argparse.ArgumentParser(description=main.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("detect")
    d.add_argument("--text", required=True)
    d.add_argument("--key", type=int, required=True)
    d.add_argument("--gamma", type=float, default=Watermark.gamma)
    d.add_argument("--model", default=None, help="model directory or .gguf (default: the embedded model)")
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    from engine.model.loader import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(a.model, float_weights=False))
    ids = tok(a.text, add_special_tokens=False).input_ids
    print(detect(ids, Watermark(a.key, a.gamma)).as_dict())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
