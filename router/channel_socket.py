"""The output channel's same-node path: an engine replica on the ingress's node writes its
`StepOutputs` to a local socket the ingress listens on, instead of yielding them through the
Ray streaming call; the call itself stays open (it is the channel's lifetime: Serve's drain,
the router's lease, a dead replica's error) and yields only a `ChannelSocketEnd` with the count
of frames written, after which the ingress has read them all.

Why: each item of a Ray streaming call costs both processes a gRPC round of the core workers'
threads and cross-thread wake-ups. At one stream every step is one item, and on a 2-core box that
CPU preempts the engine's OpenMP threads mid-step. The socket costs one write and one loop
wake-up: on a 2-core Zen 4, one stream's ingress went from 1.19 to 0.65 ms of CPU per token and
a 1,000-token decode from 8.85 to 8.13 ms per token (2 threads, the Q4_K_M file with int8
activations; `docs/performance.md`). vLLM's engine core talks to its API server over a local
socket for the same reason.

The socket is an abstract-namespace Unix socket (Linux: no file to clean up, gone with the
process). Frames are a 4-byte little-endian length and the pickled message; the first frame of a
connection is the channel call's token, a random string only that call carries: a connection
with any other first frame is closed before anything of it is unpickled. A replica on another
node, or one that cannot connect, sends over the Ray call as before. `ORBITAL_CHANNEL_SOCKET=0`
(the router's environment) sends everything over the calls (`bench.bench_spare_core --compare
channel` measures one against the other).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import struct
from dataclasses import dataclass, field
from typing import Callable

from router.messages import ChannelSocket, StepOutputs, decode

log = logging.getLogger(__name__)

HEADER = struct.Struct("<I")
MAX_TOKEN_BYTES = 64
MAX_FRAME_BYTES = 1 << 30
# How long the ingress waits for frames the replica reported sent before taking them for lost
# (they were written before the report, over a local socket: normally microseconds).
FRAMES_DUE_S = 30.0
# A connection's first frame (the token) must come this soon: the replica writes it on connecting.
HELLO_DUE_S = 5.0
# The replica waits for the ingress to read once this much is unread on its side.
DRAIN_ABOVE_BYTES = 1 << 20


def socket_enabled() -> bool:
    return os.environ.get("ORBITAL_CHANNEL_SOCKET", "1") != "0"


class ChannelLostError(ConnectionError):
    """The socket of an output channel ended before every frame the replica sent arrived."""


@dataclass
class _Channel:
    replica: str
    frames: int = 0  # frames delivered to on_batch
    ended: bool = False  # the connection is gone (or never came and the call ended)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class ChannelListener:
    """The ingress's end: one listening socket for all its channels; `open` before each call."""

    def __init__(self, node_id: str | None, on_batch: Callable[[str, StepOutputs], None]) -> None:
        self.node_id = node_id
        self.on_batch = on_batch
        self.address = f"\0orbital-channel-{secrets.token_hex(12)}"
        self._server: asyncio.AbstractServer | None = None
        self._failed = False  # the socket could not be opened here: every channel uses Ray
        self._channels: dict[str, _Channel] = {}  # token -> its call's frames
        self.frames = 0  # frames received over sockets (stats)

    async def open(self, replica: str) -> ChannelSocket | None:
        """A token for one channel call to `replica`; None: send over the Ray call."""
        if self.node_id is None or self._failed:
            return None
        if self._server is None:
            try:
                self._server = await asyncio.start_unix_server(self._serve, sock=_bound(self.address))
            except OSError as e:
                log.warning("output channels go over Ray calls: no local socket (%s)", e)
                self._failed = True
                return None
        token = secrets.token_hex(16)
        self._channels[token] = _Channel(replica)
        return ChannelSocket(self.node_id, self.address, token)

    async def wait_for(self, sock: ChannelSocket, frames: int) -> None:
        """Returns once `frames` frames of that call were delivered; ChannelLostError when its
        connection ended first or they do not come within FRAMES_DUE_S."""
        ch = self._channels[sock.token]
        loop = asyncio.get_running_loop()
        due = loop.time() + FRAMES_DUE_S
        while ch.frames < frames:
            if ch.ended or loop.time() >= due:
                raise ChannelLostError(f"output channel socket of replica {ch.replica}: {ch.frames} of {frames} frames")
            ch.changed.clear()
            try:
                await asyncio.wait_for(ch.changed.wait(), due - loop.time())
            except TimeoutError:
                pass

    def forget(self, sock: ChannelSocket) -> None:
        """The call ended: later connections with its token are refused."""
        ch = self._channels.pop(sock.token, None)
        if ch is not None:
            ch.ended = True
            ch.changed.set()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ch = None
        try:
            try:
                token = await asyncio.wait_for(_read_token(reader), HELLO_DUE_S)
            except TimeoutError:
                return  # a connection that names no call holds no descriptor here
            ch = self._channels.get(token) if token is not None else None
            if ch is None or ch.ended:
                return  # not a call of ours (or one that ended): nothing of it is read
            while True:
                (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
                if n > MAX_FRAME_BYTES:
                    raise ValueError(f"frame of {n} bytes")
                msg = decode(await reader.readexactly(n))
                self.on_batch(ch.replica, msg)
                ch.frames += 1
                self.frames += 1
                ch.changed.set()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the replica closed it (channel end) or died: its call's end says which
        except Exception:  # noqa: BLE001 - a bad frame ends this connection, not the ingress
            log.exception("output channel socket dropped")
        finally:
            if ch is not None:
                ch.ended = True
                ch.changed.set()
            writer.close()


async def _read_token(reader: asyncio.StreamReader) -> str | None:
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if n > MAX_TOKEN_BYTES:
        return None
    return (await reader.readexactly(n)).decode(errors="replace")


class ChannelWriter:
    """The engine replica's end of one channel call's connection."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self.frames = 0
        self._closed = False

    @classmethod
    async def connect(cls, sock: ChannelSocket | None, node_id: str) -> ChannelWriter | None:
        """None (send over the Ray call) when the ingress is on another node or unreachable."""
        if sock is None or sock.node_id != node_id:
            return None
        try:
            _, writer = await asyncio.open_unix_connection(sock=_connected(sock.address))
        except OSError as e:
            log.warning("output channel over the Ray call: cannot reach the ingress's socket (%s)", e)
            return None
        token = sock.token.encode()
        writer.write(HEADER.pack(len(token)) + token)
        return cls(writer)

    async def send(self, payload: bytes) -> bool:
        """Write one frame; False when the connection is gone (the ingress died or closed it)."""
        if self._writer.is_closing():
            return False
        self._writer.write(HEADER.pack(len(payload)) + payload)
        self.frames += 1
        if self._writer.transport.get_write_buffer_size() > DRAIN_ABOVE_BYTES:
            try:
                await self._writer.drain()
            except ConnectionError:
                return False
        return True

    async def close(self) -> None:
        """Flush what is written and close (again: nothing)."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self._writer.is_closing():
                await self._writer.drain()
        except ConnectionError:
            pass  # the ingress is gone: its count of frames tells it what it missed
        finally:
            self._writer.close()


# The sockets are made here and handed to asyncio: uvloop (Serve's replicas run on it) refuses an
# abstract-namespace address given as a path (EINVAL), not a socket already bound or connected.


def _bound(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(address)
        s.listen(64)
        s.setblocking(False)
    except OSError:
        s.close()
        raise
    return s


def _connected(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(address)  # a local socket: no wait, it is accepted into the listen backlog
        s.setblocking(False)
    except OSError:
        s.close()
        raise
    return s
