"""Loopback helpers shared by the test layers that start servers: a free port, a health wait."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, headers=None, timeout: float = 180.0) -> None:
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(f"{url}/health", headers=headers, timeout=10)
            if last.status_code == 200:
                return
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.5)
    raise RuntimeError(f"{url} never became healthy: {last!r}")


def listening_pid(port: int) -> int | None:
    """The process holding a TCP socket that listens on `port` (read from /proc, as `ss -ltnp`
    does), or None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{f[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return int(proc.name)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return None
