"""OpenAI's Responses API (`/v1/responses`) on top of chat completions.

A Responses request becomes a chat completions body (instructions as the first system message,
input items as messages, function tools and `text.format` as chat's tools and response_format)
and runs through the same path as `/v1/chat/completions` (the model pools, the chat template,
tool calls and structured outputs); the chat answer, or its streamed chunks, become a Response
object, or its events.

Stored responses (`store`, default true) live in this router replica's memory only, for
an hour and at most 1024 of them (response_store.py) (the oldest go first): a restart, or a request
that another router replica serves, finds no stored response (a 404, as for an unknown id).
"""

from __future__ import annotations

import itertools
import secrets
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable, Callable

from engine.errors import InvalidRequestError
from router.ingress.errors import APIError, parse_body, to_api_error
from router.ingress.response_store import ResponseStore
from router.ingress.responses_models import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    MessageItem,
    ResponsesRequest,
)
from router.ingress.streams import prepend

Chat = Callable[[dict, "str | None"], Awaitable[Any]]


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"Response with id '{response_id}' not found (responses are kept in one router replica's memory "
        "for a bounded time; store=false ones are not kept).",
        param=param,
        code="response_not_found",
    )


def input_messages(items: str | list) -> list[dict]:
    """Responses input as chat messages: function calls join the assistant turn before them,
    function outputs become tool messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


def chat_body(req: ResponsesRequest, messages: list[dict]) -> dict:
    """The chat completions body that does what `req` asks."""
    body: dict[str, Any] = {"messages": messages, "stream": req.stream}
    if req.model is not None:
        body["model"] = req.model
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for field, value in (
        ("max_completion_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("user", req.user),
    ):
        if value is not None:
            body[field] = value
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in req.tools
        ]
    if isinstance(req.tool_choice, FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    body["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        schema: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema_}
        if fmt.description is not None:
            schema["description"] = fmt.description
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    return body


def _usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": chat_usage["total_tokens"],
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    """A pool's reasoning parser's `reasoning_content` as a reasoning item (its text whole, as
    open models' reasoning is; no summary, nothing encrypted)."""
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _message_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _call_item(call: dict, status: str = "completed", arguments: str | None = None) -> dict:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": f"fc_{call['id']}",
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"] if arguments is None else arguments,
        "status": status,
    }


def _assistant_turn(text: str | None, calls: list[dict]) -> dict:
    """The output as a chat message, for the conversation a later response continues."""
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        turn["tool_calls"] = [{"id": c["id"], "type": "function", "function": dict(c["function"])} for c in calls]
    return turn


class ResponsesAPI:
    """`/v1/responses`: `chat(body, tier_hint)` is the chat completions call (the model pools')."""

    def __init__(self, chat: Chat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store if store is not None else ResponseStore()

    def retrieve(self, response_id: str) -> dict:
        found = self.store.get(response_id)
        if found is None:
            raise not_found(response_id)
        return found[0]

    def delete(self, response_id: str) -> dict:
        if not self.store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def create(self, body: dict, tier_hint: str | None = None) -> dict | AsyncIterator[dict]:
        req = parse_body(ResponsesRequest, body)
        refused = req.refused()
        if refused is not None:
            raise InvalidRequestError(f"{refused[0]}: {refused[1]}", param=refused[0])
        auto = req.tool_choice == "auto" or (req.tool_choice is None and bool(req.tools))
        if auto and not req.parallel_tool_calls:  # a tool-call parser finds every call there is
            raise InvalidRequestError(
                "parallel_tool_calls: false is honoured with tool_choice 'required' or a named function, "
                "not with 'auto'",
                param="parallel_tool_calls",
            )
        history: list[dict] = []
        if req.previous_response_id is not None:
            found = self.store.get(req.previous_response_id)
            if found is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            history = [dict(m) for m in found[1]]
        turn = input_messages(req.input)
        system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
        result = await self.chat(chat_body(req, system + history + turn), tier_hint)
        rid, created = f"resp_{secrets.token_hex(16)}", int(time.time())
        if not req.stream:
            return self._finish(req, rid, created, result, history + turn)
        try:  # errors before the first chunk keep their HTTP status
            first = await result.__anext__()
        except BaseException:
            await result.aclose()
            raise
        return self._events(req, rid, created, first, result, history + turn)

    def _response(self, req: ResponsesRequest, rid: str, created: int, model: str) -> dict:
        """A Response without output (in progress): what the request asked, echoed."""
        fmt = req.text.format if req.text is not None else None
        return {
            "id": rid,
            "object": "response",
            "created_at": created,
            "status": "in_progress",
            "model": model,
            "output": [],
            "usage": None,
            "incomplete_details": None,
            "error": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "tool_choice": (
                req.tool_choice.model_dump()
                if isinstance(req.tool_choice, FunctionChoice)
                else req.tool_choice or ("auto" if req.tools else "none")
            ),
            "parallel_tool_calls": req.parallel_tool_calls,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "truncation": "disabled",
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "metadata": req.metadata or {},
            "user": req.user,
        }

    def _done(self, response: dict, finish: str | None, usage: dict | None, conversation: list[dict]) -> dict:
        if finish == "length":
            response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        else:
            response["status"] = "completed"
        response["usage"] = _usage(usage)
        if response["store"]:
            self.store.put(response, conversation)
        return response

    def _finish(self, req: ResponsesRequest, rid: str, created: int, result: dict, conversation: list[dict]) -> dict:
        choice = result["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
        calls = message.get("tool_calls") or []
        status = "incomplete" if finish == "length" else "completed"
        response = self._response(req, rid, created, result["model"])
        if message.get("reasoning_content"):
            response["output"].append(_reasoning_item(f"rs_{rid[5:]}", message["reasoning_content"], status))
        if message.get("content") or not calls:
            response["output"].append(_message_item(f"msg_{rid[5:]}", message.get("content") or "", status))
        response["output"] += [_call_item(c) for c in calls]
        turn = _assistant_turn(message.get("content"), calls)
        return self._done(response, finish, result.get("usage"), [*conversation, turn])

    async def _events(
        self,
        req: ResponsesRequest,
        rid: str,
        created: int,
        first: dict,
        rest: AsyncIterator[dict],
        conversation: list[dict],
    ) -> AsyncIterator[dict]:
        seq = itertools.count()

        def event(kind: str, **fields: Any) -> dict:
            return {"type": kind, "sequence_number": next(seq), **fields}

        response = self._response(req, rid, created, first["model"])
        yield event("response.created", response=dict(response))
        yield event("response.in_progress", response=dict(response))
        msg_id, rs_id = f"msg_{rid[5:]}", f"rs_{rid[5:]}"
        text, thought, opened = "", "", False
        calls: list[dict] = []
        output: list[dict] = []  # items done, in order
        finish, usage = None, None
        where: dict = {}  # the message item's place, once it opens
        rs_where: dict = {}  # the reasoning item's, while it is open

        def open_message() -> list[dict]:
            where.update(item_id=msg_id, output_index=len(output), content_index=0)
            return [
                event(
                    "response.output_item.added",
                    output_index=where["output_index"],
                    item={**_message_item(msg_id, "", "in_progress"), "content": []},
                ),
                event(
                    "response.content_part.added", **where, part={"type": "output_text", "text": "", "annotations": []}
                ),
            ]

        def close_reasoning(status: str) -> list[dict]:
            part = {"type": "reasoning_text", "text": thought}
            item = _reasoning_item(rs_id, thought, status)
            events = [
                event("response.reasoning_text.done", **rs_where, text=thought),
                event("response.content_part.done", **rs_where, part=part),
                event("response.output_item.done", output_index=rs_where["output_index"], item=item),
            ]
            output.append(item)
            rs_where.clear()
            return events

        try:
            async with aclosing(rest):
                async for chunk in prepend(first, rest):
                    usage = chunk.get("usage") or usage
                    for c in chunk["choices"][:1]:
                        delta = c["delta"]
                        piece = delta.get("reasoning_content")
                        if piece:  # the parser sends all reasoning before any content
                            if not rs_where and not thought:
                                rs_where.update(item_id=rs_id, output_index=len(output), content_index=0)
                                yield event(
                                    "response.output_item.added",
                                    output_index=rs_where["output_index"],
                                    item={**_reasoning_item(rs_id, "", "in_progress"), "content": []},
                                )
                                yield event(
                                    "response.content_part.added",
                                    **rs_where,
                                    part={"type": "reasoning_text", "text": ""},
                                )
                            thought += piece
                            yield event("response.reasoning_text.delta", **rs_where, delta=piece)
                        piece = delta.get("content")
                        if piece:
                            if rs_where:
                                for e in close_reasoning("completed"):
                                    yield e
                            if not opened:
                                opened = True
                                for e in open_message():
                                    yield e
                            text += piece
                            yield event("response.output_text.delta", **where, delta=piece, logprobs=[])
                        calls += delta.get("tool_calls") or []
                        finish = c.get("finish_reason") or finish
        except Exception as e:  # noqa: BLE001 - the stream has started: the error is an event
            err = to_api_error(e)
            yield event("error", code=err.code or str(err.status), message=err.message, param=err.param)
            return
        status = "incomplete" if finish == "length" else "completed"
        if rs_where:  # reasoning to the end (cut by max_output_tokens, or no answer)
            for e in close_reasoning(status):
                yield e
        if opened or not calls:
            if not opened:
                for e in open_message():
                    yield e
            part = {"type": "output_text", "text": text, "annotations": []}
            yield event("response.output_text.done", **where, text=text, logprobs=[])
            yield event("response.content_part.done", **where, part=part)
            item = _message_item(msg_id, text, status)
            yield event("response.output_item.done", output_index=where["output_index"], item=item)
            output.append(item)
        for call in calls:
            index = len(output)
            item = _call_item(call)
            yield event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            )
            arguments = call["function"]["arguments"]
            yield event(
                "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=arguments
            )
            yield event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=arguments,
            )
            yield event("response.output_item.done", output_index=index, item=item)
            output.append(item)
        response["output"] = output
        turn = _assistant_turn(text if opened else None, calls)
        done = self._done(response, finish, usage, [*conversation, turn])
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        yield event(kind, response=done)
