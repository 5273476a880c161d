"""Output channels without Serve: the replica's outbox (one message per wake-up, ends when idle),
the router's channel consumer (reopens while requests remain, fails them when the replica lost
them or died), the router's own count of running requests per replica, and a real
EngineReplica driven directly: one message carries several requests, the channel ends by itself,
`finish` and `abort` end a request and free its KV blocks."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import time

import pytest

from router.ingress.output_reader import LostRequestsError, OutputReader
from router.messages import AbortRequest, FinishSequences, StepOutputs, SubmitRequest, decode, encode
from router.replica.outbox import Outbox
from router.replica_choice.local_load import LocalLoad


def test_outbox_batches_until_idle():
    async def run():
        box = Outbox(linger_s=0.0)
        box.active.update({"a", "b"})
        got = []

        async def read():
            async for payload in box.messages():
                got.append(decode(payload).outputs)

        reader = asyncio.create_task(read())
        await asyncio.sleep(0)
        box.put("a1")
        box.put("b1")  # same loop iteration: one message
        await asyncio.sleep(0.01)
        box.extend(["a2"])
        box.request_done("a")
        await asyncio.sleep(0.01)
        assert not reader.done()  # "b" still runs here
        box.put("b2")
        box.request_done("b")
        await asyncio.wait_for(reader, 1.0)
        return got

    assert asyncio.run(run()) == [["a1", "b1"], ["a2"], ["b2"]]


def test_outbox_keeps_the_channel_for_the_next_request_then_ends():
    """Back-to-back requests share one channel (no new stream per request); idle for linger_s,
    it ends."""

    async def run():
        box = Outbox(linger_s=0.3)
        box.active.add("a")
        got = []

        async def read():
            async for payload in box.messages():
                got.append((decode(payload).outputs, time.monotonic()))

        reader = asyncio.create_task(read())
        box.put("a1")
        box.request_done("a")
        await asyncio.sleep(0.1)
        assert not reader.done()  # idle, but lingering
        box.active.add("b")  # the router's next request, on the same channel
        box.put("b1")
        box.request_done("b")
        idle_from = time.monotonic()
        await asyncio.wait_for(reader, 2.0)
        return got, time.monotonic() - idle_from

    got, lingered = asyncio.run(run())
    assert [g for g, _ in got] == [["a1"], ["b1"]]
    assert 0.25 <= lingered < 1.5, lingered


def test_an_outbox_a_channel_reads_is_dropped_only_by_that_channel():
    """The replica drops an idle outbox when a request ends, unless a channel still reads it
    (lingering): the router's next request must land in the outbox that channel reads, not in a
    new one nobody reads until the linger ends."""

    async def run():
        box = Outbox(linger_s=1.0)  # far longer than the 0.05 s below, even on a loaded machine
        box.active.add("a")
        reader = asyncio.create_task(_drain(box))
        box.put("a1")
        box.request_done("a")
        await asyncio.sleep(0.05)
        lingering = (box.idle, box.droppable)
        await asyncio.wait_for(reader, 2.0)
        return lingering, box.droppable

    lingering, after = asyncio.run(run())
    assert lingering == (True, False)  # idle, but its channel lingers on it
    assert after  # the channel ended: now it may go


async def _drain(box: Outbox) -> None:
    async with contextlib.aclosing(box.messages()) as batches:
        async for _ in batches:
            pass


class _FakeChannelHandle:
    """`handle.options(stream=True)` for `output_channel`: each call plays the next script
    entry (a list of batches; an exception item is raised)."""

    def __init__(self, script: list[list]):
        self.script, self.calls = script, []
        self.output_channel = self

    def remote(self, router_id: str, replica_id: str | None = None, router=None, socket=None):
        self.calls.append(replica_id)
        batches = self.script.pop(0) if self.script else []

        async def gen():
            for b in batches:
                await asyncio.sleep(0)
                if isinstance(b, BaseException):
                    raise b
                yield encode(StepOutputs(b))

        return gen()


def _channels(script):
    handle, seen, errors = _FakeChannelHandle(script), [], []
    chans = OutputReader(
        handle, lambda rep, msg: seen.append((rep, msg.outputs)), lambda rep, ids, e: errors.append((rep, ids, e))
    )
    return handle, chans, seen, errors


def test_channel_reopens_while_requests_remain_and_stops_when_none():
    async def run():
        handle, chans, seen, errors = _channels([[["x"]], [["y"]]])
        chans.on_batch = lambda rep, msg: (seen.append(msg.outputs), msg.outputs == ["y"] and chans.detach(rep, "r1"))
        chans.attach("A", "r1")
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not chans._tasks:
                break
        return handle.calls, seen, errors, chans

    calls, seen, errors, chans = asyncio.run(run())
    assert calls == ["A", "A"] and seen == [["x"], ["y"]] and not errors
    assert not chans._tasks and not chans.active


def test_channel_fails_requests_when_replica_lost_them_or_died():
    async def run(script):
        handle, chans, seen, errors = _channels(script)
        chans.attach("A", "r1")
        chans.attach("A", "r2")
        for _ in range(100):
            await asyncio.sleep(0.01)
            if errors:
                break
        return handle.calls, errors, chans

    calls, errors, chans = asyncio.run(run([[], []]))  # twice nothing: the replica lost them
    assert calls == ["A", "A"] and errors[0][0] == "A" and sorted(errors[0][1]) == ["r1", "r2"]
    assert isinstance(errors[0][2], LostRequestsError) and not chans.active
    calls, errors, _ = asyncio.run(run([[["x"], RuntimeError("replica died")]]))
    assert calls == ["A"] and str(errors[0][2]) == "replica died"


def test_local_load_counts_routed_requests():
    load = LocalLoad()
    load.routed("a", "R1")
    load.routed("b", "R1")
    load.routed("c", "R2")
    load.done("a")
    assert load.get("R1") == 1 and load.get("R2") == 1 and load.get("R3") is None
    load.done("d")  # ended before Serve reported its routing: never counted
    load.routed("d", "R1")
    assert load.get("R1") == 1


# --- a real engine replica, driven without Serve -------------------------------------------


@pytest.fixture(scope="module")
def replica():
    from router.replica.deployment import EngineReplica

    rep = EngineReplica.func_or_class(dict(dtype="float32", kv_cache_memory_bytes=64 << 20, num_threads=1), 8)
    yield rep
    rep.engine.shutdown()


def _params(n_tokens: int):
    from engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)


async def _idle(rep, timeout: float = 10.0) -> dict:
    for _ in range(int(timeout / 0.05)):
        s = await rep.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["blocks_used"] == 0:
            return s
        await asyncio.sleep(0.05)
    return await rep.stats()


@pytest.mark.slow
def test_replica_channel_carries_every_request_and_ends(replica):
    ids = replica.engine.tokenizer("Tell me about the sea.").input_ids

    async def run():
        for i in range(3):
            assert await replica.submit(SubmitRequest(f"ch-{i}", ids, _params(8), "router-a", time.time())) == "local"
        return [decode(p).outputs async for p in replica.output_channel("router-a")]  # ends by itself

    msgs = asyncio.run(run())
    tokens: dict[str, int] = {}
    for m in msgs:
        for out in m:
            tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
    assert tokens == {"ch-0": 8, "ch-1": 8, "ch-2": 8}
    # One message per engine step for all three (the loop may still split a step under load):
    shared = [m for m in msgs if len({o.request_id for o in m}) > 1]
    assert len(shared) >= len(msgs) - 2 and len(msgs) <= 10, [[o.request_id for o in m] for m in msgs]
    assert not replica._outboxes and not replica._jobs


@pytest.mark.slow
@pytest.mark.parametrize("how", ["finish", "abort"])
def test_replica_finish_and_abort_end_the_request(replica, how):
    ids = replica.engine.tokenizer("Write a long story about the sea.").input_ids

    async def run():
        before = dict(replica.finished)
        steps = replica.engine.step_count
        await replica.submit(SubmitRequest(f"long-{how}", ids, _params(500), "router-b", time.time()))
        n = 0
        async for payload in replica.output_channel("router-b"):
            n += sum(len(o.new_token_ids) for o in decode(payload).outputs)
            if n >= 3 and f"long-{how}" in replica._jobs:
                await (
                    replica.finish(FinishSequences([f"long-{how}"]))
                    if how == "finish"
                    else replica.abort(AbortRequest(f"long-{how}"))
                )
        s = await _idle(replica)
        return before, steps, s

    before, steps, s = asyncio.run(run())
    assert s["blocks_used"] == 0 and s["num_running"] == 0, s
    reason = "stop" if how == "finish" else "abort"
    assert replica.finished.get(reason, 0) == before.get(reason, 0) + 1
    assert replica.engine.step_count - steps < 60  # far from the 500 tokens asked for
    assert not replica._outboxes and not replica._jobs


@pytest.mark.slow
def test_a_request_started_while_the_channel_lingers_rides_that_channel(replica):
    """A router's next request that starts after its previous one ended, while the channel
    lingers, goes out on that channel: its outputs must not wait for the linger to end and a
    new channel to open (one second of first-token latency at every other request)."""
    ids = replica.engine.tokenizer("Name three rivers.").input_ids

    async def run():
        await replica.submit(SubmitRequest("seq-0", ids, _params(4), "router-c", time.time()))
        tokens: dict[str, int] = {}
        async for payload in replica.output_channel("router-c"):
            for o in decode(payload).outputs:
                tokens[o.request_id] = tokens.get(o.request_id, 0) + len(o.new_token_ids)
            if tokens.get("seq-0") == 4 and "seq-1" not in tokens and "seq-1" not in replica._jobs:
                while "seq-0" in replica._jobs:  # its pump has ended: the channel lingers now
                    await asyncio.sleep(0.01)
                await replica.submit(SubmitRequest("seq-1", ids, _params(4), "router-c", time.time()))
        return tokens

    assert asyncio.run(run()) == {"seq-0": 4, "seq-1": 4}
    assert not replica._outboxes and not replica._jobs


# --- the same-node socket (router/channel_socket.py) ----------------------------------------


_UNPICKLED: list[bool] = []


def _flag_unpickled():
    _UNPICKLED.append(True)


class _Unpickled:
    def __reduce__(self):  # unpickling it leaves a mark
        return (_flag_unpickled, ())


def _listener():
    from router.channel_socket import ChannelListener

    got: list[tuple[str, list]] = []
    return ChannelListener("node-a", lambda rep, msg: got.append((rep, msg.outputs))), got


def test_socket_frames_arrive_in_order_and_are_counted():
    from router.channel_socket import ChannelWriter

    async def run():
        listener, got = _listener()
        sock = await listener.open("A")
        writer = await ChannelWriter.connect(sock, "node-a")
        for i in range(50):
            assert await writer.send(encode(StepOutputs([f"x{i}"])))
        await writer.close()
        await asyncio.wait_for(listener.wait_for(sock, 50), 5)
        listener.forget(sock)
        listener.close()
        return got, listener.frames

    got, frames = asyncio.run(run())
    assert got == [("A", [f"x{i}"]) for i in range(50)] and frames == 50


def test_socket_is_not_used_across_nodes_or_without_a_token():
    """A replica on another node sends over the call; a connection whose first frame is not a
    live call's token is closed before any of its frames is unpickled."""
    from router.channel_socket import HEADER, ChannelWriter

    async def run():
        listener, got = _listener()
        sock = await listener.open("A")
        assert await ChannelWriter.connect(sock, "node-b") is None
        reader, writer = await asyncio.open_unix_connection(sock.address)
        bad = b"0" * 32
        payload = pickle.dumps(_Unpickled())
        writer.write(HEADER.pack(len(bad)) + bad + HEADER.pack(len(payload)) + payload)
        eof = await asyncio.wait_for(reader.read(), 5)  # the listener hangs up
        listener.forget(sock)  # an ended call's token is refused too
        late = await ChannelWriter.connect(sock, "node-a")
        await late.send(payload)
        await late.close()
        await asyncio.sleep(0.1)
        listener.close()
        writer.close()
        return eof, got

    eof, got = asyncio.run(run())
    assert eof == b"" and got == [] and not _UNPICKLED


def test_socket_lost_before_every_frame_arrived_is_an_error():
    from router.channel_socket import ChannelLostError, ChannelWriter

    async def run():
        listener, _ = _listener()
        sock = await listener.open("A")
        writer = await ChannelWriter.connect(sock, "node-a")
        await writer.send(encode(StepOutputs(["x"])))
        await writer.close()  # the replica reports 2 frames, 1 arrives
        with pytest.raises(ChannelLostError):
            await asyncio.wait_for(listener.wait_for(sock, 2), 5)
        listener.close()

    asyncio.run(run())


@pytest.mark.slow
def test_replica_channel_over_the_socket_ends_with_its_count(replica):
    """A replica on the ingress's node writes every step to the socket; the call yields only
    the count, and the outputs add up to every token of every request."""
    from router.channel_socket import ChannelListener
    from router.messages import ChannelSocketEnd

    ids = replica.engine.tokenizer("Tell me about the hills.").input_ids

    async def run():
        got: list = []
        listener = ChannelListener(replica.node_id, lambda rep, msg: got.extend(msg.outputs))
        for i in range(2):
            await replica.submit(SubmitRequest(f"so-{i}", ids, _params(6), "router-s", time.time()))
        sock = await listener.open("local")
        calls = [
            decode(p, (StepOutputs, ChannelSocketEnd)) async for p in replica.output_channel("router-s", socket=sock)
        ]
        assert len(calls) == 1 and type(calls[0]) is ChannelSocketEnd and calls[0].frames > 0, calls
        await asyncio.wait_for(listener.wait_for(sock, calls[0].frames), 5)
        listener.close()
        return got, calls[0].frames, listener.frames

    got, frames, received = asyncio.run(run())
    tokens: dict[str, int] = {}
    for out in got:
        tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
    assert tokens == {"so-0": 6, "so-1": 6} and frames == received
    assert not replica._outboxes and not replica._jobs


def test_socket_hangs_up_on_a_connection_that_names_no_call(monkeypatch):
    """A local process that connects and sends nothing does not keep a descriptor open."""
    import router.channel_socket as cs

    monkeypatch.setattr(cs, "HELLO_DUE_S", 0.2)

    async def run():
        listener, _ = _listener()
        sock = await listener.open("A")
        reader, writer = await asyncio.open_unix_connection(sock.address)
        eof = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        listener.close()
        return eof

    assert asyncio.run(run()) == b""
