"""Server-sent events for the ingress's streaming HTTP routes: the frames (OpenAI's `data:`
lines, the Responses API's named events, TGI's bare chunks), the stream that reports a failure
in-band once the headers are sent, and the response that cuts off a client that stops reading.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.types import Message, Send

import router.tracing as tracing
from router.ingress.errors import to_api_error

if TYPE_CHECKING:
    from opentelemetry.trace import Span


class WriteDeadlineResponse(StreamingResponse):
    """A stream whose every write must be taken by the client within `write_timeout_s`: a client
    that stops reading is cut off (its request aborted, its KV blocks freed) instead of holding
    its slot until the request deadline."""

    def __init__(
        self, content: AsyncIterator[str], write_timeout_s: float, span: Span | None = None, **kwargs: Any
    ) -> None:
        super().__init__(content, **kwargs)
        self.write_timeout_s = write_timeout_s
        self.span = span  # the request's span (router/tracing.py): ended with the stream

    async def stream_response(self, send: Send) -> None:
        async def send_in_time(message: Message) -> None:
            try:
                async with asyncio.timeout(self.write_timeout_s):  # no task per write, as wait_for makes
                    await send(message)
            except TimeoutError:
                raise OSError(f"the client read nothing for {self.write_timeout_s:g} s") from None

        try:
            await super().stream_response(send_in_time)
        finally:
            await self.body_iterator.aclose()  # ends the request's generator: aborts it now
            tracing.end(self.span, {"http.response.status_code": 200})  # nothing when the stream ended it


def sse(obj: Any) -> str:
    """One `data:` frame of compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def sse_event(obj: dict) -> str:
    """The Responses API's framing: each event named by its type; no `[DONE]` at the end."""
    return f"event: {obj.get('type')}\n{sse(obj)}"


async def sse_stream(
    first: dict, rest: AsyncIterator[dict], tgi: bool, events: bool = False, span: Span | None = None
) -> AsyncIterator[str]:
    """`first` and then `rest` as frames; an error after the first chunk becomes the last frame
    (OpenAI's or TGI's error body, or a Responses API `error` event). OpenAI streams end with
    `data: [DONE]`. Ends `span` with the stream."""
    frame = sse_event if events else sse
    last = first
    failed = None
    try:
        yield frame(first)
        async for chunk in rest:
            last = chunk
            yield frame(chunk)
    except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
        err = failed = to_api_error(e)
        if events:  # the request's deadline, which ends the event stream from outside
            seq = last.get("sequence_number", 0) + 1
            body = {"type": "error", "sequence_number": seq, "code": err.code, "message": err.message}
            yield frame({**body, "param": err.param})
        else:
            yield frame(err.tgi_body() if tgi else err.openai_body())
    finally:
        await rest.aclose()
        error = failed.message if failed is not None and failed.status >= 500 else None
        tracing.end(
            span, {"http.response.status_code": 200, "error.type": failed.type if failed else None}, error=error
        )
    if not tgi and not events:
        yield "data: [DONE]\n\n"
