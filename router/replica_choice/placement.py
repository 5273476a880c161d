"""Where a routed request is counted: tentatively on the replica the choice ranked first (at
once, so a burst sees it), then on the replica whose `submit` answered (Serve may have sent it
to a later-ranked one). Serve's `on_request_routed` hook is not used: it only runs with strict
max-ongoing-requests rejection on."""

from __future__ import annotations

import logging
from typing import Sequence

from router.replica_choice.kv_index import kv_index
from router.replica_choice.local_load import local_load
from router.replica_choice.routing_log import routing_log

log = logging.getLogger(__name__)


def tentative(
    request_id: str, replica: str, policy: str, hashes: Sequence[int], predicted: dict[str, int], block_size: int
) -> None:
    """In the replica choice, for the replica ranked first."""
    local_load.routed(request_id, replica)
    kv_index.add_pending(request_id, replica, hashes)
    routing_log.proposed(request_id, policy, predicted, block_size)


def confirmed(request_id: str, replica: str) -> None:
    """In the ingress, once `submit` answered with the replica that runs the request."""
    local_load.routed(request_id, replica)
    kv_index.move_pending(request_id, replica)
    predicted = routing_log.routed(request_id, replica)
    log.debug("request %s runs on replica %s (predicted cached tokens %d)", request_id, replica, predicted)


def ended(request_id: str) -> None:
    local_load.done(request_id)
    kv_index.end_pending(request_id)
