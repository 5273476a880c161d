"""vLLM's `/tokenize` and `/detokenize`, per model pool: a prompt (as /v1/completions takes it)
or chat messages (through the chat template, as /v1/chat/completions renders them) in, the token
ids the engine would get, their count and the pool's context length out; token ids in, text out.
Clients use them to count tokens and budget a context."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field

from engine.errors import InvalidRequestError
from router.ingress.errors import parse_body
from router.ingress.openai_models import ChatMessage, TokenId, Tool, _Request
from router.ingress.openai_tools import chat_template_arguments, request_message, template_tools

if TYPE_CHECKING:
    from router.ingress.engine_client import EngineClient

MAX_DETOKENIZE = 1 << 20  # ids in one /detokenize body (the body limit bounds it too)
CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = Field(None, min_length=1, description="Text, tokenized as /v1/completions does.")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="Or chat messages, rendered by the chat template as chat completions does."
    )
    add_special_tokens: bool | None = Field(
        None, description="Add the tokenizer's special tokens; default true for a prompt, false for messages."
    )
    return_token_strs: bool = Field(False, description="Also each token's text (`token_strs`).")
    add_generation_prompt: bool | None = Field(None, description="Messages only; default true.")
    continue_final_message: bool | None = Field(None, description="Messages only; default false.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Messages only.")
    tools: list[Tool] | None = Field(None, max_length=128, description="Messages only: rendered by the template.")


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId] = Field(..., max_length=MAX_DETOKENIZE, description="Token ids to turn into text.")


def _chat_ids(client: EngineClient, req: TokenizeRequest) -> list[int]:
    kwargs = chat_template_arguments(
        client.inputs,
        req.chat_template_kwargs,
        template_tools(t.function for t in req.tools or []),
        bool(req.continue_final_message),
        req.add_generation_prompt is not False,  # default true
    )
    text, ids = client.inputs.tokenize_chat([request_message(m) for m in req.messages], **kwargs)
    return client.tokenizer(text, add_special_tokens=True).input_ids if req.add_special_tokens else ids


def _prompt_ids(client: EngineClient, req: TokenizeRequest) -> list[int]:
    client.inputs.check_chars(len(req.prompt))
    return client.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens is not False).input_ids


async def tokenize(client: EngineClient, max_model_len: int, body: dict) -> dict:
    req = parse_body(TokenizeRequest, body)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        chat_fields = [f for f in CHAT_ONLY if getattr(req, f) is not None]
        if chat_fields:
            raise InvalidRequestError(f"{chat_fields[0]} applies to messages, not a prompt", param=chat_fields[0])
    make = _prompt_ids if req.prompt is not None else _chat_ids
    ids = await client.text_work(1, make, client, req)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}
    if req.return_token_strs:
        out["token_strs"] = client.tokenizer.convert_ids_to_tokens(ids)
    return out


async def detokenize(client: EngineClient, body: dict) -> dict:
    req = parse_body(DetokenizeRequest, body)
    vocab = client.inputs.mc.vocab_size
    bad = next((t for t in req.tokens if t >= vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": await client.text_work(1, client.tokenizer.decode, req.tokens)}
