"""What the replica choice decided, per request and per replica: the routed count, the cached
prompt tokens it predicted and the cached tokens the engine then reported (`/metrics`, tests,
the debug log), the fetches from a peer it planned, and the time the decisions took.

Both counts are in whole blocks: the index predicts full-block hits only. The engine also reuses
a few tokens of the next block (engine/core/tail_hits.py, always fewer than a block), which its
own `prefix_cache_hits` and a response's `cached_tokens` include and these leave out."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv_transfer.peer_prefix import PeerPrefix

KEEP = 4096  # recent decisions kept per ingress process


@dataclass(slots=True)
class Decision:
    replica: str
    policy: str
    predicted_cached_tokens: int
    actual_cached_tokens: int | None = None
    block_size: int = 1
    # A fetch from a peer planned for this replica (router/replica_choice/peer_fetch_plan.py):
    # the holder's id and the tokens it holds (counted in predicted_cached_tokens); None: none.
    peer_source: str | None = None
    peer_tokens: int = 0


class RoutingLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.decisions: collections.OrderedDict[str, Decision] = collections.OrderedDict()
        self.per_replica: dict[str, dict[str, int]] = {}
        # request id -> (policy, predicted cached tokens per candidate replica, block size, the
        # replica a peer fetch was planned for and its hint), until routed
        self._proposals: collections.OrderedDict[str, tuple] = collections.OrderedDict()
        self.decision_seconds = 0.0
        self.num_decisions = 0

    def _counts(self, replica: str) -> dict[str, int]:
        c = self.per_replica.get(replica)
        if c is None:
            c = self.per_replica[replica] = {
                "routed": 0,
                "predicted_cached_tokens": 0,
                "actual_cached_tokens": 0,
                "peer_fetches_planned": 0,
            }
        return c

    def timed(self, seconds: float) -> None:
        with self._lock:
            self.decision_seconds += seconds
            self.num_decisions += 1

    def proposed(
        self,
        request_id: str,
        policy: str,
        predicted_tokens: dict[str, int],
        block_size: int = 1,
        peer: tuple[str, PeerPrefix] | None = None,
    ) -> None:
        """The replica choice ranked the candidates (it may run again for the same request).
        `peer`: (replica, hint) when it planned that replica's fetch from a peer."""
        with self._lock:
            self._proposals[request_id] = (policy, predicted_tokens, block_size, peer)
            if len(self._proposals) > KEEP:
                self._proposals.popitem(last=False)

    def routed(self, request_id: str, replica: str) -> int:
        """The request runs on `replica` (its `submit` answered): the prediction for that one."""
        with self._lock:
            policy, predicted, block_size, peer = self._proposals.pop(request_id, ("unknown", {}, 1, None))
            predicted_tokens = predicted.get(replica, 0)
            d = Decision(replica, policy, predicted_tokens, block_size=block_size)
            if peer is not None and peer[0] == replica:
                d.peer_source, d.peer_tokens = peer[1].source, peer[1].num_tokens
            self.decisions[request_id] = d
            if len(self.decisions) > KEEP:
                self.decisions.popitem(last=False)
            c = self._counts(replica)
            c["routed"] += 1
            c["predicted_cached_tokens"] += predicted_tokens
            c["peer_fetches_planned"] += d.peer_source is not None
            return predicted_tokens

    def decision(self, request_id: str) -> Decision | None:
        """The decision recorded for a routed request (None: not routed, or long gone)."""
        with self._lock:
            return self.decisions.get(request_id)

    def finished(self, request_id: str, actual_tokens: int) -> None:
        """`actual_tokens`: the engine's cached tokens for the request, a tail hit's included."""
        with self._lock:
            d = self.decisions.get(request_id)
            if d is None or d.actual_cached_tokens is not None:
                return
            actual_tokens -= actual_tokens % d.block_size
            d.actual_cached_tokens = actual_tokens
            self._counts(d.replica)["actual_cached_tokens"] += actual_tokens

    def stats(self) -> dict:
        with self._lock:
            return {
                "per_replica": {r: dict(c) for r, c in self.per_replica.items()},
                "decision_seconds": self.decision_seconds,
                "decisions": self.num_decisions,
            }

    def recent(self) -> dict[str, dict]:
        with self._lock:
            return {
                rid: {
                    "replica": d.replica,
                    "policy": d.policy,
                    "predicted_cached_tokens": d.predicted_cached_tokens,
                    "actual_cached_tokens": d.actual_cached_tokens,
                    "peer_source": d.peer_source,
                    "peer_tokens": d.peer_tokens,
                }
                for rid, d in self.decisions.items()
            }
