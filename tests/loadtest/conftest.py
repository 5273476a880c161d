"""Fixtures for the load-tester tests: a fault-injecting OpenAI-compatible SSE server
(FastAPI + uvicorn in a thread on a free 127.0.0.1 port, one per test module). The behaviour is picked per request by a ``MODE:<name>``
marker in the prompt (or the last chat message):

ok, nousage (no usage chunk), fail500, drop (connection cut mid-stream), error_event (an error
object inside the stream), no_done (ends cleanly without [DONE]), short (stops early with
finish_reason "stop"), slow (first token after 2 s).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

TTFT_S = 0.05
ITL_S = 0.01


def make_app(ttft: float = TTFT_S, itl: float = ITL_S) -> FastAPI:
    app = FastAPI()
    counters = {"requests": 0, "in_flight": 0}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        n = counters["requests"]
        return PlainTextResponse(
            f"# TYPE fake:prefix_cache_hits_total counter\nfake:prefix_cache_hits_total {10 * n}\n"
            f"fake:prefix_cache_queries_total {40 * n}\n"
            f"fake:num_requests_running {counters['in_flight']}\nfake:num_requests_waiting 0\n"
            f"fake:kv_cache_usage_perc 0.5\nfake:num_preemptions_total {n // 2}\n"
        )

    async def handle(request: Request, chat: bool):
        body = await request.json()
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        m = re.search(r"MODE:(\w+)", text)
        mode = m.group(1) if m else "ok"
        counters["requests"] += 1
        if mode == "fail500":
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, status_code=500)
        n = int(body.get("max_tokens", 16))
        usage_on = (body.get("stream_options") or {}).get("include_usage") and mode != "nousage"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(tok: str | None, finish=None) -> str:
            if chat:
                choice = {
                    "index": 0,
                    "delta": {"content": tok} if tok is not None else {"role": "assistant"},
                    "finish_reason": finish,
                }
            else:
                choice = {"index": 0, "text": tok or "", "finish_reason": finish}
            return (
                "data: " + json.dumps({"id": "x", "object": obj, "model": "fake-model", "choices": [choice]}) + "\n\n"
            )

        async def stream():
            counters["in_flight"] += 1
            try:
                async for part in _stream():
                    yield part
            finally:
                counters["in_flight"] -= 1

        async def _stream():
            if chat:
                yield chunk(None)
            await asyncio.sleep(2.0 if mode == "slow" else ttft)
            emit = n // 2 if mode in ("drop", "error_event", "short") else n
            for i in range(emit):
                if i:
                    await asyncio.sleep(itl)
                yield chunk(f" tok{i}", "length" if i == n - 1 else None)
            if mode == "drop":
                raise RuntimeError("injected stream drop")
            if mode == "error_event":
                yield (
                    "data: "
                    + json.dumps({"error": {"message": "injected", "type": "server_error", "code": 500}})
                    + "\n\n"
                )
                yield "data: [DONE]\n\n"
                return
            if mode == "short":
                yield chunk("", "stop")
            if usage_on:
                u = {
                    "prompt_tokens": 7,
                    "completion_tokens": emit,
                    "total_tokens": 7 + emit,
                    "prompt_tokens_details": {"cached_tokens": 3},
                }
                yield "data: " + json.dumps({"id": "x", "object": obj, "choices": [], "usage": u}) + "\n\n"
            if mode != "no_done":
                yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


class FakeServer:
    def __init__(self, ttft: float = TTFT_S, itl: float = ITL_S):
        self.ttft, self.itl = ttft, itl
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        cfg = uvicorn.Config(make_app(ttft, itl), log_level="critical", lifespan="off")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> "FakeServer":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("fake server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def fake_server():
    server = FakeServer().start()
    yield server
    server.stop()
