"""What one ingress process knows for routing, in one object: the exact index of the replicas'
cached blocks (`kv_index`), the requests it runs on each replica (`local_load`), the decisions
and their outcomes (`log`), the replicas it knows to be gone (`unreachable`) and the request
routers Serve built in this process (`routers`, by app and deployment).

Serve builds the request router itself (no constructor argument of ours reaches it), and the
ingress that sends the calls is another object in the same process: both reach the one
`routing_state()` of the process."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from router.replica_choice.exclusion import Unreachable
from router.replica_choice.kv_index import KVIndex
from router.replica_choice.local_load import LocalLoad
from router.replica_choice.routing_log import RoutingLog

if TYPE_CHECKING:
    from engine.kv_transfer.peer_prefix import PeerPrefix

log = logging.getLogger(__name__)


@dataclass
class RoutingState:
    kv_index: KVIndex = field(default_factory=KVIndex)
    local_load: LocalLoad = field(default_factory=LocalLoad)
    log: RoutingLog = field(default_factory=RoutingLog)
    unreachable: Unreachable = field(default_factory=Unreachable)
    routers: dict[tuple[str, str], Any] = field(default_factory=dict)

    # --- the request routers of this process ------------------------------------------------

    def register(self, app_name: str, deployment_name: str, router: Any) -> None:
        self.routers[(app_name, deployment_name)] = router

    def router(self, app_name: str, deployment_name: str) -> Any:
        """The request router of that deployment in this process (None before its first call)."""
        return self.routers.get((app_name, deployment_name))

    def known_replicas(self, app_name: str, deployment_name: str) -> list[tuple[str, dict[str, Any]]]:
        """(unique replica id, last routing stats) for every replica the local router knows."""
        r = self.routers.get((app_name, deployment_name))
        if r is None:
            return []
        return [(rep.replica_id.unique_id, dict(rep.routing_stats or {})) for rep in r.replicas]

    # --- where a routed request is counted ----------------------------------------------------
    # Tentatively on the replica the router ranked first (at once, so a burst sees it), then on
    # the replica whose `submit` answered (Serve may have sent it to a later-ranked one). Serve's
    # `on_request_routed` hook is not used: it only runs with strict max-ongoing-requests
    # rejection on.

    def tentative(
        self,
        request_id: str,
        replica: str,
        policy: str,
        hashes: Sequence[int],
        predicted: dict[str, int],
        block_size: int,
        peer: PeerPrefix | None = None,
    ) -> None:
        """In the request router, for the replica ranked first (`peer`: the fetch planned for it)."""
        self.local_load.routed(request_id, replica)
        self.kv_index.add_pending(request_id, replica, hashes)
        self.log.proposed(request_id, policy, predicted, block_size, (replica, peer) if peer is not None else None)

    def confirmed(self, request_id: str, replica: str) -> None:
        """In the ingress, once `submit` answered with the replica that runs the request."""
        self.local_load.routed(request_id, replica)
        self.kv_index.move_pending(request_id, replica)
        predicted = self.log.routed(request_id, replica)
        log.debug("request %s runs on replica %s (predicted cached tokens %d)", request_id, replica, predicted)

    def ended(self, request_id: str) -> None:
        self.local_load.done(request_id)
        self.kv_index.end_pending(request_id)


_PROCESS_STATE = RoutingState()


def routing_state() -> RoutingState:
    return _PROCESS_STATE
