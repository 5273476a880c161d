"""Validate prompts and turn one user request into engine `Request`s (n>1 -> n sequences)."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Sequence

from engine.errors import InvalidRequestError, PromptTooLongError
from engine.request import Request, child_request_ids
from engine.sampling_params import SamplingParams
from engine.structured.matcher import GrammarTokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.lora.request import LoRARequest
    from engine.model_config import ModelConfig

PromptInput = str | dict | Sequence[int]

# apply_chat_template's parameters and the variables it sets itself: never from a client.
_RESERVED_TEMPLATE_ARGS = frozenset(
    {
        "chat_template",
        "tokenize",
        "tools",
        "documents",
        "conversation",
        "messages",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "bos_token",
        "eos_token",
        "raise_exception",
        "strftime_now",
    }
)


def _template_variables(template: str | dict | None) -> frozenset[str]:
    """Free variables of a chat template (every named template when there are several)."""
    import jinja2
    from jinja2 import meta

    sources = list(template.values()) if isinstance(template, dict) else [template] if template else []
    names: set[str] = set()
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    for src in sources:
        try:
            names |= meta.find_undeclared_variables(env.parse(src))
        except jinja2.TemplateSyntaxError:
            continue
    return frozenset(names - _RESERVED_TEMPLATE_ARGS)


class InputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, model_config: ModelConfig, prefix_caching: bool) -> None:
        self.tokenizer, self.mc, self.prefix_caching = tokenizer, model_config, prefix_caching
        self._template_vars: frozenset[str] | None = None
        self.grammar_tokenizer = GrammarTokenizer(tokenizer, model_config.vocab_size, model_config.eos_token_ids)

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequestError("prompt is empty", param="prompt")
            self.check_chars(len(prompt))
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, (list, tuple)):
            return None, self.check_token_ids(prompt)
        raise InvalidRequestError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", param="prompt"
        )

    def check_token_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise InvalidRequestError("prompt_token_ids must be a non-empty list of integers", param="prompt")
        v = self.mc.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < v:
                raise InvalidRequestError(f"token id {t!r} is outside the vocabulary [0, {v})", param="prompt")
        return list(ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidRequestError("each message needs 'role' and 'content'", param="messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; use completions", param="messages")
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def template_variables(self, requested: dict[str, Any]) -> dict[str, Any]:
        """The client's `chat_template_kwargs`, reduced to variables this model's chat template
        reads (e.g. `enable_thinking`). apply_chat_template's own parameters (`chat_template`,
        `tokenize`, `tools`, ...) are refused: a client must not swap the template or reach
        features by the back door. Variables the template never reads are dropped."""
        bad = sorted(k for k in requested if k in _RESERVED_TEMPLATE_ARGS)
        if bad:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(bad)}", param="chat_template_kwargs"
            )
        if self._template_vars is None:
            self._template_vars = _template_variables(getattr(self.tokenizer, "chat_template", None))
        return {k: v for k, v in requested.items() if k in self._template_vars}

    def tokenize_chat(self, messages: list[dict], **kwargs: Any) -> tuple[str, list[int]]:
        text = self.apply_chat_template(messages, **kwargs)
        self.check_chars(len(text))
        return text, self.tokenizer(text, add_special_tokens=False).input_ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: its longest vocabulary entry (a byte-level
        or SentencePiece entry is never shorter than its text)."""
        return max((len(t) for t in self.tokenizer.get_vocab()), default=1) or 1

    def check_chars(self, num_chars: int) -> None:
        """PromptTooLongError, before tokenizing, for text that cannot fit the context in any
        tokenization: a client's megabytes are refused without holding a thread on them."""
        limit = self.mc.max_model_len
        if num_chars > limit * self.max_token_chars:
            raise PromptTooLongError(
                f"This model's maximum context length is {limit} tokens; the prompt has {num_chars} characters, "
                f"more than {limit} tokens can hold (at most {self.max_token_chars} characters each).",
                param="prompt",
            )

    @staticmethod
    def truncate(prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as the request runs it: its last `truncate_prompt_tokens` tokens."""
        n = params.truncate_prompt_tokens
        return prompt_ids[-n:] if n is not None and len(prompt_ids) > n else prompt_ids

    def tokenize_for(self, prompt: PromptInput, params: SamplingParams) -> tuple[str | None, list[int]]:
        """`tokenize`, then `truncate`; a cut prompt's text is dropped (it no longer matches)."""
        text, ids = self.tokenize(prompt)
        kept = self.truncate(ids, params)
        return (text if len(kept) == len(ids) else None), kept

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """The checks of a request that need the model: PromptTooLongError unless prompt + output
        fit the context, InvalidRequestError for a logit_bias or stop token outside the
        vocabulary or min_tokens past the output's room. Returns max_tokens."""
        v = self.mc.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < v]
            if bad:
                raise InvalidRequestError(f"{name} token {bad[0]} is outside the vocabulary [0, {v})", param=name)
        p, limit = len(prompt_ids), self.mc.max_model_len
        if params.pooling is not None:  # an embedding: the prompt alone, up to the whole context
            if p > limit:
                raise PromptTooLongError(
                    f"This model's maximum context length is {limit} tokens; the input has {p} tokens.",
                    param="prompt",
                )
            return 1
        if p >= limit:
            raise PromptTooLongError(
                f"This model's maximum context length is {limit} tokens; the prompt has {p} tokens "
                "(at least one token must be left for the completion).",
                param="prompt",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - p
        if p + max_tokens > limit:
            raise PromptTooLongError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{p + max_tokens} tokens ({p} in the prompt, {max_tokens} for the completion). "
                "Reduce the prompt or max_tokens.",
                param="max_tokens",
            )
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({params.min_tokens}) must be <= the completion's room ({max_tokens} tokens)",
                param="min_tokens",
            )
        return max_tokens

    def make_requests(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        resume: dict[str, list[int]] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[Request]:
        """`resume` (a request moved here from another replica): child id -> the output tokens it
        generated there. Only those children are made, each with its outputs restored (not part of
        the prompt), so they continue like a preempted request that recomputes: penalties,
        min/max tokens, stop checks and seeded draws (keyed by output position) go on unchanged."""
        prompt_ids = self.truncate(prompt_ids, params)
        max_tokens = self.check_request(prompt_ids, params)
        if params.top_k >= self.mc.vocab_size:  # keeps every token: the same as off, and fits int64
            params = dataclasses.replace(params, top_k=0)
        eos = self.mc.eos_token_ids
        reqs = []
        for i, rid in enumerate(child_request_ids(request_id, params.n)):
            if resume is not None and rid not in resume:
                continue  # finished before the move
            sp = (
                params
                if params.n == 1
                else dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            )
            if len(eos) > 1 and not sp.ignore_eos:  # extra EOS ids (e.g. Llama 3) stop like EOS
                sp = dataclasses.replace(sp, stop_token_ids=list(dict.fromkeys(sp.stop_token_ids + list(eos[1:]))))
            # With prefix caching on, the client's salt keeps its blocks among requests with the
            # same salt; with it off, siblings share prompt blocks through the hash map all the same.
            if self.prefix_caching:
                salt = params.cache_salt
            else:
                salt = f"n:{request_id}" if params.n > 1 else None
            kw = {} if arrival_time is None else {"arrival_time": arrival_time}
            so = sp.structured_output
            if so is not None:  # each sequence its own place in the grammar
                kw["grammar"] = self.grammar_tokenizer.matcher(so.grammar, so.param, so.after_token_ids)
                if resume is not None and not kw["grammar"].accept_all(resume[rid]):
                    raise InvalidRequestError(f"{so.param}: the output to resume does not match", param=so.param)
            reqs.append(
                Request(
                    rid,
                    list(prompt_ids),
                    sp,
                    eos_token_id=eos[0] if eos else None,
                    priority=priority,
                    cache_salt=salt,
                    max_tokens=max_tokens,
                    output_token_ids=list(resume[rid]) if resume is not None else [],
                    lora_request=lora_request,
                    **kw,
                )
            )
        return reqs
