"""OpenAI API on top of EngineClient: request -> SamplingParams, RequestOutputs -> responses.

`completions(body)` / `chat_completions(body)` return a response dict, or (stream=True) an async
iterator of chunk dicts; the HTTP layer adds SSE framing and `data: [DONE]`, the Python handle
API hands the dicts out as they are. One OpenAIServing serves one model pool; `served_as` is the
name the client asked for when that is not the pool's own (an alias: `router/ingress/model_pools.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from contextlib import aclosing
from typing import AsyncIterator

from engine.errors import InvalidRequestError
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.watermark import Watermark, detect
from router.ingress.engine_client import EngineClient, new_request_id
from router.ingress.errors import APIError, error_status, parse_body
from router.ingress.lora_adapters import LoRAAdapters
from router.ingress.openai_logprobs import chat_logprobs, completion_logprobs
from router.ingress.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    WatermarkDetectRequest,
)
from router.ingress.openai_sampling import sampling_params
from router.ingress.openai_tools import ToolMode, assistant_message, chat_template_arguments, request_message
from router.ingress.reasoning_parsers import END as REASONING_END
from router.ingress.reasoning_parsers import ReasoningParser, ReasoningStream
from router.ingress.streams import collect, merge
from router.ingress.tool_parsers import ContentStream

MAX_PROMPTS = 64  # prompts in one completions request (each is a request to the engine)


# Serve's logger: its lines land in the ingress replica's log file, beside Serve's own.
serve_log = logging.getLogger("ray.serve")


def _log_user(rid: str, user: str | None) -> None:
    """OpenAI's `user`: the end user a request is made for, so that operators can find a user's
    requests when they look into abuse. Logged with the request id (repr: no line breaks)."""
    if user:
        serve_log.info("request %s is for user %r", rid, user)


def _usage(prompt_tokens: int, outs: list[RequestOutput], cached: bool = True, reasoning: int | None = None) -> dict:
    """`reasoning`: the output tokens a reasoning parser counted as reasoning (None: no parser)."""
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    usage: dict = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }
    if cached:  # prefix-cache hits, as OpenAI reports them (the engine's count at first schedule)
        usage["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens for o in outs)}
    if reasoning is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


def _check_errors(out: RequestOutput) -> None:
    if out.error is not None:
        raise APIError(error_status(out), out.error)


class OpenAIServing:
    def __init__(
        self,
        client: EngineClient,
        model_name: str,
        max_model_len: int,
        tool_call_parser: str | None = None,
        report_cached_tokens: bool = True,
        watermark: Watermark | None = None,
        reasoning_parser: str | None = None,
        loras: LoRAAdapters | None = None,
    ) -> None:
        self.client, self.model_name, self.max_model_len = client, model_name, max_model_len
        self.tool_call_parser = tool_call_parser  # tool_choice "auto" (tool_parsers.py); None: refused
        self.report_cached_tokens = report_cached_tokens
        self.watermark = watermark  # the deployment's (AppConfig.watermark_key_file); None: refused
        self.reasoning_parser = reasoning_parser  # <think> blocks to reasoning_content; None: left in content
        self.loras = loras  # the pool's LoRA adapters, named as `model` (lora_adapters.py); None: off

    def lora_of(self, model: str | None) -> LoRARequest | None:
        return self.loras.get(model) if self.loras is not None else None

    def _watermarked(self, req, params: SamplingParams) -> SamplingParams:
        if not req.watermark:
            return params
        if self.watermark is None:
            raise InvalidRequestError("watermark: this deployment has no watermark key", param="watermark")
        return dataclasses.replace(params, watermark=self.watermark)

    async def detect_watermark(self, body: dict) -> dict:
        """/v1/watermark/detect: a text's (or token ids') z-score against the deployment's key."""
        req = parse_body(WatermarkDetectRequest, body)
        if self.watermark is None:
            raise InvalidRequestError("watermark: this deployment has no watermark key", param="watermark")
        if (req.text is None) == (req.token_ids is None):
            raise InvalidRequestError("give exactly one of text and token_ids", param="text")
        ids = self.client.inputs.check_token_ids(req.token_ids) if req.token_ids is not None else None
        if ids is None:
            tok = self.client.tokenizer
            ids = await self.client.text_work(1, lambda: tok(req.text, add_special_tokens=False).input_ids)
        return {"object": "watermark.detection", **detect(ids, self.watermark).as_dict()}

    def models(self) -> dict:
        card = ModelCard(id=self.model_name, root=self.model_name, max_model_len=self.max_model_len)
        return ModelList(data=[card]).model_dump()

    def check_model(self, model: str | None, served_as: str | None = None) -> str:
        """The name responses carry: `served_as` (the alias the client asked for) or the pool's own.
        404 for any other name."""
        if model not in (None, "", self.model_name, served_as) and self.lora_of(model) is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return served_as or self.model_name

    # --- /v1/completions --------------------------------------------------------------------

    async def completions(self, body: dict, served_as: str | None = None) -> dict | AsyncIterator[dict]:
        req = parse_body(CompletionRequest, body)
        name = self.check_model(req.model, served_as)
        if req.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequestError("best_of must equal n (or be left out)", param="best_of")
        prompt_lp = req.logprobs if (req.echo and req.logprobs is not None) else None
        params = self._watermarked(req, sampling_params(req, req.max_tokens, req.logprobs, prompt_lp))
        prompts = await self._prompts(req.prompt, params)
        rid, arrival = new_request_id("cmpl"), time.time()
        _log_user(rid, req.user)
        streams = [
            self.client.generate(
                f"{rid}-{i}", text, ids, params, arrival, req.priority, req.stream, self.lora_of(req.model)
            )
            for i, (text, ids) in enumerate(prompts)
        ]
        if req.stream:
            return self._stream_completions(req, rid, name, prompts, streams, params.n)
        outs = await collect(streams)
        choices = []
        for i, out in enumerate(outs):
            _check_errors(out)
            echo = self._prompt_text(out) if req.echo else ""
            for c in out.outputs:
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs(
                        c.logprobs or [],
                        out.prompt_logprobs if req.echo else None,
                        out.prompt_token_ids,
                        self.client.token_text,
                        0,
                    )
                choices.append(
                    {
                        "index": i * params.n + c.index,
                        "text": echo + c.text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(arrival),
            "model": name,
            "choices": choices,
            "usage": _usage(sum(len(ids) for _, ids in prompts), outs, self.report_cached_tokens),
        }

    async def _prompts(self, prompt, params) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, list) and not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        items = prompt if isinstance(prompt, list) and not isinstance(prompt[0], int) else [prompt]
        if len(items) > MAX_PROMPTS:
            raise InvalidRequestError(f"prompt accepts at most {MAX_PROMPTS} prompts", param="prompt")
        tokenize = self.client.inputs.tokenize_for
        return await self.client.text_work(len(items), lambda: [tokenize(p, params) for p in items])

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.client.tokenizer.decode(out.prompt_token_ids)

    async def _stream_completions(
        self, req: CompletionRequest, rid: str, name: str, prompts, streams, n: int
    ) -> AsyncIterator[dict]:
        created = int(time.time())
        finals: dict[int, RequestOutput] = {}
        latest: dict[int, RequestOutput] = {}  # each prompt's output so far (continuous usage)
        num_prompt = sum(len(ids) for _, ids in prompts)
        offsets: dict[int, int] = {}  # choice index -> characters sent (logprobs text_offset)
        done: set[int] = set()
        async with aclosing(merge(streams)) as merged:
            async for i, out in merged:
                _check_errors(out)
                if out.finished:
                    finals[i] = out
                latest[i] = out
                choices = self._completion_choices(req, out, i * n, offsets, done)
                if choices:
                    body = {"id": rid, "object": "text_completion", "created": created, "model": name}
                    body["choices"] = choices
                    if req.stream_options and req.stream_options.continuous_usage_stats:
                        body["usage"] = _usage(num_prompt, list(latest.values()), self.report_cached_tokens)
                    yield body
        if req.stream_options and req.stream_options.include_usage:
            usage = _usage(sum(len(ids) for _, ids in prompts), list(finals.values()), self.report_cached_tokens)
            yield {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": name,
                "choices": [],
                "usage": usage,
            }

    def _completion_choices(
        self, req: CompletionRequest, out: RequestOutput, base: int, offsets: dict[int, int], done: set[int]
    ) -> list[dict]:
        """Stream choices for one RequestOutput: only sequences with news (text, logprobs, end)."""
        choices = []
        for c in out.outputs:
            idx = base + c.index
            if idx in done:
                continue
            text, prompt_lps = c.text_delta, None
            if req.echo and idx not in offsets:
                text, prompt_lps = self._prompt_text(out) + text, out.prompt_logprobs
            if not text and not c.finished and not c.logprobs_delta:
                continue
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(
                    c.logprobs_delta or [],
                    prompt_lps,
                    out.prompt_token_ids,
                    self.client.token_text,
                    offsets.get(idx, 0),
                )
            offsets[idx] = offsets.get(idx, 0) + len(text)
            if c.finished:
                done.add(idx)
            choices.append(
                {
                    "index": idx,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return choices

    # --- /v1/chat/completions ---------------------------------------------------------------

    async def chat_completions(self, body: dict, served_as: str | None = None) -> dict | AsyncIterator[dict]:
        req = parse_body(ChatCompletionRequest, body)
        name = self.check_model(req.model, served_as)
        tools = ToolMode(req, self.tool_call_parser)
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, None)
        params = self._watermarked(req, params)
        held_calls = tools.constraint()  # a named function or "required"; "auto" may take a grammar too
        if held_calls is not None:
            if params.structured_output is not None:
                raise InvalidRequestError("tool calls exclude response_format and structured_outputs", "tool_choice")
            params = dataclasses.replace(params, structured_output=held_calls)
        reasoning, params = self._reasoning(req, params)
        messages = [request_message(m) for m in req.messages]
        kwargs = chat_template_arguments(
            self.client.inputs,
            req.chat_template_kwargs,
            tools.template_tools(),
            req.continue_final_message,
            req.add_generation_prompt,
        )
        text, ids = await self.client.text_work(1, lambda: self.client.inputs.tokenize_chat(messages, **kwargs))
        if params.truncate_prompt_tokens is not None and len(ids) > params.truncate_prompt_tokens:
            text, ids = None, self.client.inputs.truncate(ids, params)
        rid, arrival = new_request_id("chatcmpl"), time.time()
        _log_user(rid, req.user)
        stream = self.client.generate(
            rid, text, ids, params, arrival, req.priority, req.stream, self.lora_of(req.model)
        )
        if req.stream:
            return self._stream_chat(req, rid, name, len(ids), stream, tools, reasoning)
        (out,) = await collect([stream])
        _check_errors(out)
        choices = []
        for c in out.outputs:
            thought, text = reasoning.split(c.text) if reasoning else (None, c.text)
            message, finish = assistant_message(text or "", c.finish_reason, tools)
            if reasoning:
                message["reasoning_content"] = thought
                message["content"] = message["content"] or None
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": chat_logprobs(c.logprobs, self.client.token_text) if req.logprobs else None,
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason,
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(arrival),
            "model": name,
            "choices": choices,
            "usage": _usage(len(ids), [out], self.report_cached_tokens, self._reasoning_tokens(reasoning, out)),
        }

    def _reasoning_tokens(self, reasoning: ReasoningParser | None, out: RequestOutput) -> int | None:
        if reasoning is None:
            return None
        return sum(reasoning.reasoning_tokens(c.token_ids, self.client.token_text) for c in out.outputs)

    def _reasoning(
        self, req: ChatCompletionRequest, params: SamplingParams
    ) -> tuple[ReasoningParser | None, SamplingParams]:
        """The request's reasoning parser (None: none configured), and its sampling parameters:
        a grammar (structured outputs, held tool calls) starts after the reasoning, where the
        output first holds `</think>`'s tokens, as vLLM starts it; with reasoning off (the
        prompt closed the block) it holds the whole output."""
        if self.reasoning_parser is None:
            return None, params
        parser = ReasoningParser(self.reasoning_parser, req.chat_template_kwargs)
        so = params.structured_output
        if so is not None and parser.thinking:
            params = dataclasses.replace(params, structured_output=so.starting_after(self._reasoning_end_ids))
        return parser, params

    @functools.cached_property
    def _reasoning_end_ids(self) -> list[int]:
        """`</think>` as the pool's tokenizer encodes it (one added token in R1's and Qwen3's)."""
        return self.client.tokenizer(REASONING_END, add_special_tokens=False).input_ids

    async def _stream_chat(
        self,
        req: ChatCompletionRequest,
        rid: str,
        name: str,
        num_prompt: int,
        stream,
        tools: ToolMode,
        reasoning: ReasoningParser | None = None,
    ) -> AsyncIterator[dict]:
        """With tool calls the text is held back: the calls go out whole in the last delta. With a
        reasoning parser the reasoning goes out as `reasoning_content`; the rest is the content."""
        created = int(time.time())
        started: set[int] = set()
        done: set[int] = set()
        held: dict[int, ContentStream] = {}  # tool_choice "auto": content before the first call
        thinking: dict[int, ReasoningStream] = {}  # per choice: reasoning apart from content
        last = None

        def chunk(choices: list[dict]) -> dict:
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": name,
                "choices": choices,
            }

        async for out in _closing(stream):
            _check_errors(out)
            last = out
            choices = []
            for c in out.outputs:
                if c.index in done:
                    continue
                delta: dict = {}
                full, thought = c.text, ""
                if reasoning:
                    split = thinking.setdefault(c.index, reasoning.stream())
                    thought, text = split.finish(c.text) if c.finished else split.delta(c.text)
                    full = split.content
                else:
                    text = c.text_delta
                if tools.active:  # held back: a named/required call whole, "auto" from its first block
                    text = held.setdefault(c.index, ContentStream(tools.parser)).delta(full) if tools.auto else ""
                if thought:
                    delta["reasoning_content"] = thought
                if c.index not in started:
                    started.add(c.index)
                    delta["role"] = "assistant"
                    if text or not thought:  # the first delta has a content ("" until there is some)
                        delta["content"] = text
                elif text:
                    delta["content"] = text
                finish = c.finish_reason
                if c.finished and tools.active:
                    message, finish = assistant_message(full, c.finish_reason, tools)
                    rest = held[c.index].rest(full, bool(message["tool_calls"])) if tools.auto else None
                    if message["tool_calls"]:
                        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
                    elif rest is None:
                        delta["content"] = message["content"]
                    elif rest:  # after this step's own content: the tail held back as a possible tag
                        delta["content"] = delta.get("content", "") + rest
                if not delta and not c.finished and not c.logprobs_delta:
                    continue
                lp = chat_logprobs(c.logprobs_delta or [], self.client.token_text) if req.logprobs else None
                if c.finished:
                    done.add(c.index)
                choices.append(
                    {
                        "index": c.index,
                        "delta": delta,
                        "logprobs": lp,
                        "finish_reason": finish,
                        "stop_reason": c.stop_reason,
                    }
                )
            if choices:
                if req.stream_options and req.stream_options.continuous_usage_stats:
                    usage = _usage(num_prompt, [out], self.report_cached_tokens, self._reasoning_tokens(reasoning, out))
                    yield {**chunk(choices), "usage": usage}
                else:
                    yield chunk(choices)
        if req.stream_options and req.stream_options.include_usage and last is not None:
            usage = _usage(num_prompt, [last], self.report_cached_tokens, self._reasoning_tokens(reasoning, last))
            yield {**chunk([]), "usage": usage}


async def _closing(stream: AsyncIterator) -> AsyncIterator:
    """Iterate and always close `stream` (a consumer that stops early must not leave it to GC)."""
    async with aclosing(stream):
        async for item in stream:
            yield item
