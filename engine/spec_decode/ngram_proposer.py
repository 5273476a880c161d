"""Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) and propose the k tokens that followed it.

Per request the tokens live in a growing numpy buffer (appended, never rebuilt), and the
search narrows the positions equal to the last token one offset at a time, so a step costs one
vectorised comparison over the sequence plus a few over the surviving candidates.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.spec_decode.proposer import Proposer


class _TokenBuffer:
    def __init__(self) -> None:
        self.data = np.empty(256, dtype=np.int64)
        self.n = 0

    def sync(self, token_ids: Sequence[int]) -> np.ndarray:
        """The buffer made equal to `token_ids` (which only grow while a request lives)."""
        m = len(token_ids)
        if m < self.n:
            self.n = 0
        if m > len(self.data):
            grown = np.empty(max(m, 2 * len(self.data)), dtype=np.int64)
            grown[: self.n] = self.data[: self.n]
            self.data = grown
        if m > self.n:
            self.data[self.n : m] = token_ids[self.n : m]
            self.n = m
        return self.data[:m]


def ngram_lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """The k tokens after the latest earlier match of the longest suffix n-gram (n >= min_n)."""
    size = len(tokens)
    if k <= 0 or size < min_n + 1:
        return []
    # Candidate match ends j (< size - 1, so something follows them) with tokens[j] == last.
    cand = np.flatnonzero(tokens[: size - 1] == tokens[size - 1])
    best, length = cand, 1
    for t in range(1, max_n):
        cand = cand[cand >= t]
        cand = cand[tokens[cand - t] == tokens[size - 1 - t]]
        if len(cand) == 0:
            break
        best, length = cand, t + 1
    if length < min_n or len(best) == 0:
        return []
    j = int(best[-1]) + 1  # the latest match: repetitive outputs repeat their recent past
    return tokens[j : j + k].tolist()


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._buffers: dict[str, _TokenBuffer] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        buf = self._buffers.get(request_id)
        if buf is None:
            buf = self._buffers[request_id] = _TokenBuffer()
        return ngram_lookup(buf.sync(token_ids), k, self.min_n, self.max_n)

    def forget(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)
