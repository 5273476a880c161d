"""A stream's writes must each be taken within `write_timeout_s` (router/ingress/sse.py): a client
that stops reading is cut off and its generator closed (which aborts its request), while a
client that reads gets every chunk."""

from __future__ import annotations

import asyncio

import pytest

from router.ingress.sse import WriteDeadlineResponse


def _body(closed: list):
    async def gen():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    return gen()


def test_a_client_that_stops_reading_is_cut_at_the_deadline():
    async def run():
        closed: list = []
        taken: list = []
        stalled = asyncio.Event()  # never set: the client's socket buffer is full

        async def send(message):
            if len(taken) >= 3:
                await stalled.wait()
            taken.append(message)

        response = WriteDeadlineResponse(_body(closed), write_timeout_s=0.2, media_type="text/event-stream")
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(OSError, match="read nothing for 0.2 s"):
            await asyncio.wait_for(response.stream_response(send), 10)  # a hang fails, not blocks
        return loop.time() - start, taken, closed

    elapsed, taken, closed = asyncio.run(run())
    assert 0.2 <= elapsed < 2.0 and len(taken) == 3 and closed == [True]


def test_a_client_that_reads_gets_every_chunk():
    async def run():
        closed: list = []
        bodies: list = []

        async def send(message):
            await asyncio.sleep(0)
            bodies.append(message.get("body", b""))

        await WriteDeadlineResponse(_body(closed), write_timeout_s=0.2, media_type="text/event-stream").stream_response(
            send
        )
        return b"".join(bodies), closed

    body, closed = asyncio.run(run())
    assert body == "".join(f"data: {i}\n\n" for i in range(1000)).encode() and closed == [True]
