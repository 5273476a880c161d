"""TGI API on top of EngineClient: /generate (one response), /generate_stream (one SSE event per
token, the last one with `generated_text` and `details`), / (either, by `stream`), /info.

As in TGI, a stop sequence stays in `generated_text`, `do_sample=false` means greedy unless a
sampling parameter is set, and every token carries its logprob.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import aclosing
from typing import AsyncIterator

from engine.errors import AdapterNotFoundError, InvalidRequestError
from engine.outputs import CompletionOutput
from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput
from engine.watermark import Watermark
from router.ingress.engine_client import EngineClient, new_request_id
from router.ingress.errors import APIError, error_status, parse_body
from router.ingress.lora_adapters import LoRAAdapters
from router.ingress.streams import collect
from router.ingress.tgi_models import Details, GenerateParameters, GenerateRequest, StreamDetails, StreamResponse, Token


def sampling_params(p: GenerateParameters, want_logprobs: bool) -> SamplingParams:
    # GenerateParameters' own bounds refuse best_of > 1, temperature <= 0, top_n_tokens outside
    # [0, 20] (and the schema says so); SamplingParams and StructuredOutput check the rest.
    sample = (
        p.do_sample
        or (p.temperature not in (None, 1.0))
        or bool(p.top_k)
        or (p.top_p not in (None, 1.0))
        or (p.typical_p not in (None, 1.0))
    )
    logprobs = p.top_n_tokens or 0 if (want_logprobs or p.top_n_tokens) else None
    return SamplingParams(
        temperature=(p.temperature or 1.0) if sample else 0.0,
        top_p=p.top_p or 1.0,
        top_k=p.top_k or 0,
        typical_p=p.typical_p or 1.0,
        repetition_penalty=p.repetition_penalty or 1.0,
        frequency_penalty=p.frequency_penalty or 0.0,
        seed=p.seed,
        max_tokens=p.max_new_tokens,
        stop=list(p.stop),
        include_stop_str_in_output=True,
        logprobs=logprobs,
        prompt_logprobs=0 if p.decoder_input_details else None,
        structured_output=StructuredOutput(p.grammar.type, p.grammar.value, param="grammar") if p.grammar else None,
        truncate_prompt_tokens=p.truncate,
    )


def finish_reason(c: CompletionOutput) -> str:
    if c.finish_reason == "length":
        return "length"
    if isinstance(c.stop_reason, str):
        return "stop_sequence"
    return "eos_token"


class TGIServing:
    def __init__(
        self,
        client: EngineClient,
        model_name: str,
        info: dict,
        watermark: Watermark | None = None,
        loras: LoRAAdapters | None = None,
    ) -> None:
        self.client, self.model_name, self.info_body = client, model_name, info
        self.watermark = watermark  # the deployment's (AppConfig.watermark_key_file); None: refused
        self.loras = loras  # the LoRA adapters `adapter_id` names (lora_adapters.py); None: none served
        self.special = set(getattr(client.tokenizer, "all_special_ids", []) or [])

    def info(self) -> dict:
        return dict(self.info_body)

    async def _start(self, body: dict, stream: bool):
        req = parse_body(GenerateRequest, body)
        p = req.parameters
        lora = None
        if p.adapter_id is not None:
            lora = self.loras.get(p.adapter_id) if self.loras is not None else None
            if lora is None:
                served = "no adapters are served by this deployment" if self.loras is None else "no such adapter"
                raise AdapterNotFoundError(f"adapter_id: {p.adapter_id!r}: {served}", param="adapter_id")
        if p.watermark and self.watermark is None:
            raise InvalidRequestError("watermark: this deployment has no watermark key", param="watermark")
        params = sampling_params(p, want_logprobs=stream or p.details)
        if p.watermark:
            params = dataclasses.replace(params, watermark=self.watermark)
        text, ids = await self.client.text_work(1, self.client.inputs.tokenize_for, req.inputs, params)
        if "max_new_tokens" not in p.model_fields_set and params.max_tokens is not None:
            # TGI's default of 100 is not something the client asked for: never refuse a request
            # over it, take what the context has left.
            params.max_tokens = max(1, min(params.max_tokens, self.info_body["max_total_tokens"] - len(ids)))
        rid = new_request_id("tgi")
        out_stream = self.client.generate(
            rid, text, ids, params, time.time(), p.priority, stream=stream, lora_request=lora
        )
        return req, ids, out_stream

    def _token(self, tid: int, logprob: float | None, text: str | None = None) -> Token:
        if text is None:
            text = self.client.token_text(tid)
        return Token(id=tid, text=text, logprob=logprob, special=tid in self.special)

    async def generate(self, body: dict) -> dict:
        req, ids, stream = await self._start(body, stream=False)
        (out,) = await collect([stream])
        if out.error is not None:
            raise APIError(error_status(out), out.error)
        c = out.outputs[0]
        text = (req.inputs + c.text) if req.parameters.return_full_text else c.text
        resp: dict = {"generated_text": text}
        if req.parameters.details:
            lps = c.logprobs or []
            tokens = [self._token(t, lps[i].logprob if i < len(lps) else None) for i, t in enumerate(c.token_ids)]
            prefill = []
            if req.parameters.decoder_input_details:
                plps = out.prompt_logprobs or []
                prefill = [
                    self._token(t, plps[i].logprob if i < len(plps) and plps[i] else None) for i, t in enumerate(ids)
                ]
            top = None
            if req.parameters.top_n_tokens:
                top = [[self._token(t, v) for t, v in lp.top] for lp in lps]
            resp["details"] = Details(
                finish_reason=finish_reason(c),
                generated_tokens=len(c.token_ids),
                seed=req.parameters.seed,
                prefill=prefill,
                tokens=tokens,
                top_tokens=top,
            ).model_dump()
        return resp

    async def generate_stream(self, body: dict) -> AsyncIterator[dict]:
        req, ids, stream = await self._start(body, stream=True)
        return self._events(req, ids, stream)

    async def _events(self, req: GenerateRequest, ids: list[int], stream) -> AsyncIterator[dict]:
        index, last_tid = 0, 0
        async with aclosing(stream):
            async for out in stream:
                if out.error is not None:
                    raise APIError(error_status(out), out.error)
                c = out.outputs[0]
                new, lps = c.token_ids_delta or [], c.logprobs_delta or []
                for k, tid in enumerate(new):
                    last = k == len(new) - 1  # the step's text goes with its last token
                    yield self._event(
                        req,
                        ids,
                        c,
                        index,
                        tid,
                        lps[k] if k < len(lps) else None,
                        c.text_delta if last else "",
                        c.finished and last,
                    )
                    index, last_tid = index + 1, tid
                if c.finished and not new:  # ended without a new token (flush after a stop)
                    yield self._event(req, ids, c, index, last_tid, None, c.text_delta, True)

    def _event(
        self,
        req: GenerateRequest,
        ids: list[int],
        c: CompletionOutput,
        index: int,
        tid: int,
        lp,
        text: str,
        final: bool,
    ) -> dict:
        ev = StreamResponse(index=index, token=self._token(tid, lp.logprob if lp is not None else None, text))
        if req.parameters.top_n_tokens and lp is not None:
            ev.top_tokens = [self._token(t, v) for t, v in lp.top]
        if final:
            full = c.text
            ev.generated_text = (req.inputs + full) if req.parameters.return_full_text else full
            ev.details = StreamDetails(
                finish_reason=finish_reason(c),
                generated_tokens=len(c.token_ids),
                input_length=len(ids),
                seed=req.parameters.seed,
            )
        return ev.model_dump()
