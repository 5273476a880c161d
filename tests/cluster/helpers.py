"""Shared by the cluster tests: an SSE completions client, Serve replica-state polling, ports."""

from __future__ import annotations

import json
import time

import httpx

from tests.net import free_port, wait_healthy  # noqa: F401 - re-exported for the cluster tests


def replica_states(app: str, deployment: str = "EngineReplica") -> dict[str, int]:
    """{"RUNNING": 2, "STOPPING": 1, ...} from the Serve controller (no dashboard needed)."""
    from ray import serve

    app_status = serve.status().applications.get(app)
    if app_status is None or deployment not in app_status.deployments:
        return {}
    return {str(getattr(k, "value", k)): v for k, v in app_status.deployments[deployment].replica_states.items() if v}


def completion_body(prompt: str | list[int], max_tokens: int, stream: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def stream_completion(client: httpx.AsyncClient, url: str, prompt: str | list[int], max_tokens: int) -> dict:
    """One streamed /v1/completions call: text, finish_reason, usage, whether [DONE] came, errors,
    and start / first chunk / end times (monotonic)."""
    out = {
        "text": "",
        "finish_reason": None,
        "usage": None,
        "done": False,
        "error": None,
        "status": None,
        "t_start": time.monotonic(),
        "t_first": None,
        "t_end": None,
        "chunks": 0,
    }
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=completion_body(prompt, max_tokens, True)) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["error"] = (await r.aread()).decode(errors="replace")
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out["done"] = True
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    out["error"] = obj["error"]
                    continue
                out["chunks"] += 1
                if out["t_first"] is None:
                    out["t_first"] = time.monotonic()
                for ch in obj.get("choices", []):
                    out["text"] += ch.get("text") or ""
                    out["finish_reason"] = ch.get("finish_reason") or out["finish_reason"]
                if obj.get("usage"):
                    out["usage"] = obj["usage"]
    except Exception as e:  # noqa: BLE001 - reported by the test
        out["error"] = repr(e)
    finally:
        out["t_end"] = time.monotonic()
    return out


def complete(result: dict, max_tokens: int) -> bool:
    """The stream carried its full output: every token, a `length` finish, [DONE], no error."""
    return (
        result["status"] == 200
        and result["error"] is None
        and result["done"]
        and result["finish_reason"] == "length"
        and result["usage"] is not None
        and result["usage"]["completion_tokens"] == max_tokens
    )
