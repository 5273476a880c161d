"""Async streaming client for /v1/completions and /v1/chat/completions (OpenAI SSE).

Counts one token per content chunk, asks for ``stream_options.include_usage`` and trusts the
server's usage when it comes. Every failure ends as ``success=False`` with an error kind.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from loadtest import records as R
from loadtest.records import RequestRecord
from loadtest.workloads import RequestSpec


@dataclass
class ClientConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id of GET /v1/models
    api: str = "auto"  # auto (chat when the spec has messages) | completions | chat
    ignore_eos: bool = True  # sends ignore_eos + min_tokens: forces max_tokens tokens
    temperature: float = 0.0
    timeout: float = 300.0  # whole-request bound, seconds
    api_key: str | None = None
    extra_body: dict = field(default_factory=dict)

    @property
    def root(self) -> str:
        url = self.base_url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def endpoint_and_body(spec: RequestSpec, cfg: ClientConfig, model: str) -> tuple[str, dict]:
    chat = cfg.api == "chat" or (cfg.api == "auto" and spec.messages is not None)
    body: dict = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": cfg.temperature,
    }
    if chat:
        body["messages"] = spec.messages if spec.messages is not None else [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = (
            spec.prompt
            if spec.prompt is not None
            else "\n".join(f"{m['role']}: {m['content']}" for m in spec.messages) + "\nassistant:"
        )
    if cfg.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = spec.max_tokens
    body.update(cfg.extra_body)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


async def discover_model(client: httpx.AsyncClient, cfg: ClientConfig) -> str:
    if cfg.model:
        return cfg.model
    try:
        r = await client.get(cfg.root + "/v1/models", headers=cfg.headers(), timeout=10)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return "default"


def _chunk_text(choice: dict) -> str:
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


async def send(
    client: httpx.AsyncClient, cfg: ClientConfig, model: str, spec: RequestSpec, run_start: float | None = None
) -> RequestRecord:
    """Send one streaming request and measure it. Never raises for request-level failures."""
    path, body = endpoint_and_body(spec, cfg, model)
    rec = RequestRecord(
        id=spec.id, kind=spec.kind, prompt_tokens=spec.prompt_tokens, expected_output_tokens=spec.max_tokens
    )
    t0 = time.perf_counter()
    rec.start = t0 - run_start if run_start is not None else 0.0
    last = None
    try:
        async with asyncio.timeout(cfg.timeout):
            async with client.stream(
                "POST",
                cfg.root + path,
                json=body,
                headers=cfg.headers(),
                timeout=httpx.Timeout(cfg.timeout, connect=min(cfg.timeout, 10.0)),
            ) as resp:
                rec.http_status = resp.status_code
                if resp.status_code != 200:
                    rec.retry_after = resp.headers.get("retry-after")
                    text = (await resp.aread()).decode(errors="replace")
                    return rec.fail(f"http_{resp.status_code}", text)
                done, usage, event = False, None, None
                async for line in resp.aiter_lines():
                    if not line:
                        event = None
                        continue
                    if line.startswith("event:"):
                        event = line[6:].strip()
                        continue
                    if not line.startswith("data:"):
                        continue  # comments (":"), id:, retry:
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        return rec.fail(R.BAD_CHUNK, data)
                    if event == "error" or (isinstance(obj, dict) and obj.get("error")):
                        err = obj.get("error", obj) if isinstance(obj, dict) else obj
                        return rec.fail(R.STREAM_ERROR, json.dumps(err))
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for choice in obj.get("choices") or []:
                        if choice.get("finish_reason"):
                            rec.finish_reason = choice["finish_reason"]
                        if not _chunk_text(choice):
                            continue
                        now = time.perf_counter()
                        if last is None:
                            rec.ttft = now - t0
                        else:
                            rec.itl.append(now - last)
                        last = now
                        rec.chunk_tokens.append(1)
                rec.latency = time.perf_counter() - t0
                if not done:
                    return rec.fail(R.NO_DONE, "stream ended without [DONE]")
    except (TimeoutError, httpx.TimeoutException) as e:
        return rec.fail(R.TIMEOUT, f"{type(e).__name__}: {e}")
    except httpx.ConnectError as e:
        return rec.fail(R.CONNECT, f"{type(e).__name__}: {e}")
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        return rec.fail(R.DROPPED, f"{type(e).__name__}: {e}")
    except httpx.HTTPError as e:
        return rec.fail(R.OTHER, f"{type(e).__name__}: {e}")
    return _finish(rec, usage, cfg)


def _finish(rec: RequestRecord, usage: dict | None, cfg: ClientConfig) -> RequestRecord:
    counted = sum(rec.chunk_tokens)
    rec.output_tokens = counted
    if usage:
        rec.usage_reported = True
        rec.output_tokens = int(usage.get("completion_tokens") or counted)
        rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])
    if rec.output_tokens == 0 or rec.ttft is None:
        return rec.fail(R.EMPTY, "no tokens in the stream")
    if cfg.ignore_eos and rec.output_tokens < rec.expected_output_tokens:
        # Without usage, chunks may carry several tokens: trust finish_reason "length" then.
        if usage or rec.finish_reason != "length":
            return rec.fail(R.SHORT, f"{rec.output_tokens} of {rec.expected_output_tokens} tokens")
    rec.success = True
    return rec
