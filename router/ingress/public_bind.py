"""No unauthenticated endpoint on a public interface: the ingress refuses to start when Serve's
HTTP proxy binds anything but loopback and no API key is set, unless the operator said
`allow_unauthenticated`."""

from __future__ import annotations

import ipaddress
import logging

from router.config import AppConfig

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: may resolve to anything
        return False


def check_public_bind(cfg: AppConfig, host: str | None) -> str | None:
    """Raise when `host` (the HTTP bind address; None: unknown, taken as public: the check fails
    closed) is public and nothing authenticates requests; else return the API key (None: none)."""
    key = cfg.resolve_api_key()
    if key or cfg.allow_unauthenticated or (host is not None and is_loopback(host)):
        return key
    where = "an unknown address" if host is None else f"{host!r} (not a loopback address)"
    raise PermissionError(
        f"refusing to serve without an API key on {where}: set api_key, "
        "api_key_file or $ORBITAL_API_KEY, or allow_unauthenticated (--allow-unauthenticated) "
        "if something in front of it authenticates requests"
    )


def serve_http_host() -> str | None:
    """The host Serve's HTTP proxy binds, asked from the Serve controller (None if unknown)."""
    try:
        import ray
        from ray.serve.context import _get_global_client

        return ray.get(_get_global_client()._controller.get_http_config.remote(), timeout=30).host
    except Exception as e:  # noqa: BLE001 - a private Serve API: never block a start on it
        log.warning("could not read Serve's HTTP bind address (%s); taken as public", e)
        return None
