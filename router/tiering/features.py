"""What the tier policy sees of an OpenAI request: its prompt text and length, its token budget,
and whether it asks for tools or a structured output. Read from the raw body before the pool's
validation (a body the pool then refuses is refused the same way whichever pool it meets)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

STRUCTURED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass(frozen=True)
class RequestFeatures:
    text: str  # the prompt's text (chat: every message's text, one per line); "" for token ids
    prompt_tokens: int  # as the tier's first pool's tokenizer counts `text` (or the ids given)
    max_tokens: int | None  # None: the client set no budget (the context's rest)
    has_tools: bool
    has_response_format: bool  # a JSON schema / object, regex, choice or grammar


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _prompt(body: dict) -> tuple[str, int | None]:
    """(text, token count when the prompt is given as ids)."""
    if isinstance(body.get("messages"), list):
        return "\n".join(_message_text(m.get("content")) for m in body["messages"] if isinstance(m, dict)), None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return "", len(prompt)
    if isinstance(prompt, list) and all(isinstance(p, list) for p in prompt):
        return "", max((len(p) for p in prompt), default=0)
    if isinstance(prompt, list):
        return "\n".join(p for p in prompt if isinstance(p, str)), None
    return "", 0


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def request_features(body: dict, count_tokens: Callable[[str], int]) -> RequestFeatures:
    text, ids = _prompt(body)
    max_tokens = _int(body.get("max_completion_tokens"))
    if max_tokens is None:
        max_tokens = _int(body.get("max_tokens"))
    fmt = body.get("response_format")
    structured = isinstance(fmt, dict) and fmt.get("type") not in (None, "text")
    return RequestFeatures(
        text=text,
        prompt_tokens=ids if ids is not None else (count_tokens(text) if text else 0),
        max_tokens=max_tokens,
        has_tools=bool(body.get("tools")) and body.get("tool_choice") != "none",
        has_response_format=structured or any(body.get(f) is not None for f in STRUCTURED_FIELDS),
    )
