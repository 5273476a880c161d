"""No unauthenticated endpoint on a public interface: the CLI refuses to start one (a real
process, before Ray starts), the ingress refuses too, and the key may come from a file."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from router.config import AppConfig
from router.ingress.public_bind import check_public_bind, is_loopback

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow


def test_loopback_addresses():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "example.internal"))


def test_public_bind_needs_a_key_or_an_explicit_opt_out(tmp_path, monkeypatch):
    monkeypatch.delenv("ORBITAL_API_KEY", raising=False)
    with pytest.raises(PermissionError, match="0.0.0.0"):
        check_public_bind(AppConfig(), "0.0.0.0")
    check_public_bind(AppConfig(), "127.0.0.1")
    with pytest.raises(PermissionError, match="unknown address"):  # fails closed
        check_public_bind(AppConfig(), None)
    check_public_bind(AppConfig(api_key="k"), "0.0.0.0")
    check_public_bind(AppConfig(allow_unauthenticated=True), "0.0.0.0")
    key = tmp_path / "key"
    key.write_text("from-file\n")
    assert AppConfig(api_key_file=str(key)).resolve_api_key() == "from-file"
    check_public_bind(AppConfig(api_key_file=str(key)), "0.0.0.0")
    with pytest.raises(PermissionError, match="cannot read"):  # a missing file never means "no key"
        check_public_bind(AppConfig(api_key_file=str(tmp_path / "absent")), "0.0.0.0")
    key.write_text("\n")
    with pytest.raises(PermissionError, match="empty"):
        AppConfig(api_key_file=str(key)).resolve_api_key()
    monkeypatch.setenv("ORBITAL_API_KEY", "from-env")
    assert AppConfig().resolve_api_key() == "from-env"


def test_cli_refuses_a_public_bind_without_a_key():
    env = {k: v for k, v in os.environ.items() if k != "ORBITAL_API_KEY"}
    r = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--host", "0.0.0.0", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 2 and "refusing to serve without an API key" in r.stderr, r.stderr


def test_cli_refuses_a_port_in_use_before_starting_ray():
    """The router replica binds the port itself (router/direct_ingress.py), deep inside Serve,
    where a clash would only show as a replica retrying: the CLI checks first and says so."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "router.cli", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 2 and f"127.0.0.1:{port} is in use" in r.stderr, r.stderr
