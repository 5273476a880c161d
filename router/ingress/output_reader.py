"""The ingress side of output channels (see `router/replica/outbox.py`): one reader task per
engine replica this ingress has requests on, handing each decoded `StepOutputs` to a callback.

A channel is opened (a streaming call pinned to the replica) when the first request there is
attached, and reopened while requests remain when the replica ended it; the replica ends it
once this ingress has nothing left there, so an idle ingress holds no call open (Serve's graceful
drain on scale-down waits for open calls). A replica on this node writes the outputs to this
ingress's local socket instead of yielding them (router/channel_socket.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from typing import TYPE_CHECKING, Callable

import ray

from router.channel_socket import ChannelListener, socket_enabled
from router.messages import ChannelSocketEnd, StepOutputs, decode

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.serve.handle import DeploymentHandle

log = logging.getLogger(__name__)


class LostRequestsError(RuntimeError):
    pass


class OutputReader:
    def __init__(
        self,
        stream_handle: DeploymentHandle,
        on_batch: Callable[[str, StepOutputs], None],
        on_error: Callable[[str, list[str], BaseException], None],
    ) -> None:
        self.stream_handle = stream_handle
        self.ingress_id = f"ingress-{uuid.uuid4().hex}"
        # This ingress's own actor, handed to each channel: a replica being drained, which no
        # pinned call (a lease renewal) can reach, asks it whether this ingress lives.
        self.actor = _current_actor()
        self.on_batch, self.on_error = on_batch, on_error
        node = _current_node() if socket_enabled() else None
        self.socket = ChannelListener(node, lambda replica, msg: self.on_batch(replica, msg))
        self.call_messages = 0  # StepOutputs that came over the calls (stats; the socket counts its own)
        self.active: dict[str, set[str]] = {}  # replica id -> request ids waiting for outputs
        self._tasks: dict[str, asyncio.Task] = {}

    def attach(self, replica: str, request_id: str) -> None:
        self.active.setdefault(replica, set()).add(request_id)
        if replica not in self._tasks:
            # A fresh context: Serve cancels the calls a request made when that request is
            # cancelled (client gone); the channel serves every request, not the one opening it.
            self._tasks[replica] = asyncio.get_running_loop().create_task(
                self._run(replica), context=contextvars.Context()
            )

    def detach(self, replica: str, request_id: str) -> None:
        ids = self.active.get(replica)
        if ids is not None:
            ids.discard(request_id)
            if not ids:
                del self.active[replica]

    def load(self, replica: str) -> int:
        return len(self.active.get(replica, ()))

    async def _run(self, replica: str) -> None:
        empty = 0  # channel calls in a row that brought nothing
        try:
            while replica in self.active:
                sock = await self.socket.open(replica)
                gen = self.stream_handle.output_channel.remote(
                    self.ingress_id, replica_id=replica, router=self.actor, socket=sock
                )
                got = False
                try:
                    async for payload in gen:
                        msg = decode(payload, (StepOutputs, ChannelSocketEnd))
                        if type(msg) is ChannelSocketEnd:  # the rest came over the socket
                            await self.socket.wait_for(sock, msg.frames)
                            got = got or msg.frames > 0
                            continue
                        got = True
                        self.call_messages += 1
                        self.on_batch(replica, msg)
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():
                        raise  # close(): this ingress is going away
                    # The call was cancelled on its own (not by us): open it again.
                finally:
                    if sock is not None:
                        self.socket.forget(sock)
                empty = 0 if got else empty + 1
                if empty and replica in self.active:
                    # The replica has nothing for requests we still wait for: it lost them
                    # (restarted, shut down). Look once more, then fail them.
                    if empty >= 2:
                        raise LostRequestsError(f"engine replica {replica} no longer runs these requests")
                    await asyncio.sleep(0.05)
            # No await between the check above and the pop below: a request attached after
            # the check finds no task and starts a new one.
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the replica is gone: its requests fail
            log.warning("output channel of replica %s failed: %s", replica, e)
            self.on_error(replica, list(self.active.pop(replica, ())), e)
        finally:
            self._tasks.pop(replica, None)

    def close(self) -> None:
        for t in list(self._tasks.values()):
            t.cancel()
        self.socket.close()


def _current_node() -> str | None:
    """This process's Ray node id; None outside Ray (no replica could tell it is on the same node)."""
    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


def _current_actor() -> ActorHandle | None:
    """The Ray actor this code runs in (a Serve replica); None outside one. Asking Ray's runtime
    context starts a local Ray where none runs, so a reader outside Ray (unit use) asks nothing."""
    if not ray.is_initialized():
        return None
    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError:  # a driver, not an actor
        return None
