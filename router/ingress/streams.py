"""Helpers over async iterators: run several streams of RequestOutput to completion or interleave
them; put back a stream's first item once it has been read."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import AsyncIterator, TypeVar

from engine.outputs import RequestOutput

_END = object()
T = TypeVar("T")


async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    out = None
    async with aclosing(stream):
        async for out in stream:
            pass
    if out is None or not out.finished:
        raise RuntimeError("the engine stream ended without a finished output")
    return out


async def collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Final outputs of all streams, in order; the first failure cancels the others and is
    raised as it is (a TaskGroup's ExceptionGroup would hide its status: a 429 or 400 on one
    prompt of a multi-prompt completion must answer as that, not 500)."""
    if len(streams) == 1:
        return [await last(streams[0])]
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(last(s)) for s in streams]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t in done and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) as they arrive from any stream; an error in one ends all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as s:
            async for out in s:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(s):
                async for out in s:
                    await queue.put((i, out))
            await queue.put((i, _END))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))

    tasks = [asyncio.get_running_loop().create_task(pump(i, s)) for i, s in enumerate(streams)]
    open_streams = len(streams)
    try:
        while open_streams:
            i, item = await queue.get()
            if item is _END:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """`first`, then the rest of the stream it was read from (closed with this one)."""
    async with aclosing(rest):
        yield first
        async for item in rest:
            yield item
