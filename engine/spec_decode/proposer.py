"""The proposer interface: draft tokens for one request from its tokens so far.

N-gram lookup needs only the token ids; a draft model or self-drafting proposer would keep its
own per-request state (its KV blocks) and release it in `forget`.
"""

from __future__ import annotations

import abc
from typing import Sequence


class Proposer(abc.ABC):
    @abc.abstractmethod
    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens likely to follow `token_ids` (prompt + output so far); [] for none."""

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: drop whatever is kept for it."""
