"""Start a server from a command line and wait until it answers GET /health or /v1/models."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time

import httpx


def wait_ready(root: str, timeout: float = 600.0, proc: subprocess.Popen | None = None) -> None:
    """Until GET /health answers 200; /v1/models only where the server has no /health (404). A
    server's /v1/models may answer before its engines can take a request (Orbital's does)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        try:
            health = httpx.get(root.rstrip("/") + "/health", timeout=5.0).status_code
            if health == 200:
                return
            if health == 404 and httpx.get(root.rstrip("/") + "/v1/models", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet, or its health check waits for engines still starting
        time.sleep(0.5)
    raise TimeoutError(f"{root} not ready after {timeout:.0f} s")


class ServerProcess:
    """``with ServerProcess(cmd, root): ...`` runs ``cmd`` in its own process group, waits for it,
    and stops that group (SIGTERM, then SIGKILL) on exit. ``cmd=None`` only waits for ``root``."""

    def __init__(
        self,
        cmd: str | None,
        root: str,
        timeout: float = 600.0,
        log_path: str | None = None,
        env: dict[str, str] | None = None,
    ):
        """`env`: variables added to this process's environment for the server."""
        self.cmd, self.root, self.timeout, self.log_path, self.env = cmd, root, timeout, log_path, env
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        if self.cmd:
            log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
            self.proc = subprocess.Popen(
                shlex.split(self.cmd),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **self.env} if self.env else None,
            )
        try:
            wait_ready(self.root, self.timeout, self.proc)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
