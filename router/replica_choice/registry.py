"""The replica-choice instances of this process, by (app, deployment): the ingress lists the
engine replicas it knows through them (stats and health fan-out)."""

from __future__ import annotations

from typing import Any

_CHOICES: dict[tuple[str, str], Any] = {}


def register(app_name: str, deployment_name: str, choice: Any) -> None:
    _CHOICES[(app_name, deployment_name)] = choice


def known_replicas(app_name: str, deployment_name: str) -> list[tuple[str, dict[str, Any]]]:
    """(unique replica id, last routing stats) for every replica the local router knows."""
    r = _CHOICES.get((app_name, deployment_name))
    if r is None:
        return []
    return [(rep.replica_id.unique_id, dict(rep.routing_stats or {})) for rep in r.replicas]


def choice(app_name: str, deployment_name: str) -> Any:
    """The replica-choice instance of that deployment in this process (None before first use)."""
    return _CHOICES.get((app_name, deployment_name))
