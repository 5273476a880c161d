"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.choices import POOLING_TYPES
from engine.errors import InvalidRequestError
from engine.structured.spec import StructuredOutput
from engine.watermark import Watermark

_GREEDY_EPS = 1e-5
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512  # per stop string: bounds the text side's hold-back check (stop_checker.py)
MAX_STOP_TOKEN_IDS = 256  # the scheduler checks every sampled token against them
MAX_N = 128
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "typical_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    typical_p: float = 1.0  # locally typical sampling (transformers' TypicalLogitsWarper); 1: off
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs per sampled token (0: only the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    structured_output: StructuredOutput | None = None  # the output must match it (engine/structured/)
    # Prefix-cache blocks are shared only among requests with the same salt (vLLM's cache_salt):
    # a tenant cannot probe another's prompts through cached_tokens.
    cache_salt: str | None = None
    # Keep only the last N prompt tokens (vLLM's truncate_prompt_tokens, TGI's truncate).
    truncate_prompt_tokens: int | None = None
    # Green-list watermark (engine/watermark.py): the deployment's key, gamma and delta.
    watermark: Watermark | None = None
    # Set: an embedding request (engine/runner/pooling.py), "last" or "mean" pooling of the prompt's
    # final-norm hidden states. It runs the prompt only, samples nothing and finishes at its end
    # with `EngineCoreOutput.embedding`.
    pooling: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {msg}", param=param)

        for name in _FLOAT_FIELDS:  # NaN and infinity pass every range check below
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, f"must be a finite number, got {v!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.n > MAX_N:
            raise bad("n", f"must be <= {MAX_N}, got {self.n}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 < self.typical_p <= 1:
            raise bad("typical_p", f"must be in (0, 1], got {self.typical_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"accepts at most {MAX_STOP_STRINGS} strings")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise bad("stop", f"strings must be at most {MAX_STOP_CHARS} characters long")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"accepts at most {MAX_STOP_TOKEN_IDS} ids")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= 20):
                raise bad(name, f"must be an integer in [0, 20], got {v!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        for t, b in (self.logit_bias or {}).items():
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise bad("logit_bias", f"keys must be token ids (integers >= 0), got {t!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                raise bad("logit_bias", f"values must be numbers in [-100, 100], got {b!r}")
        if self.logit_bias is not None and len(self.logit_bias) > 1024:
            raise bad("logit_bias", "accepts at most 1024 tokens")
        if self.truncate_prompt_tokens is not None and (
            not isinstance(self.truncate_prompt_tokens, int) or self.truncate_prompt_tokens < 1
        ):
            raise bad("truncate_prompt_tokens", f"must be an integer >= 1, got {self.truncate_prompt_tokens!r}")
        if self.watermark is not None and not isinstance(self.watermark, Watermark):
            raise bad("watermark", "must be an engine.watermark.Watermark")
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not 0 < len(self.cache_salt) <= 256
        ):
            raise bad("cache_salt", "must be a string of 1 to 256 characters")
        if self.pooling is not None:
            if self.pooling not in POOLING_TYPES:
                raise bad("pooling", f"must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
            if self.n != 1 or self.prompt_logprobs is not None or self.structured_output is not None:
                raise bad("pooling", "an embedding request takes no n, prompt_logprobs or structured output")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise bad("structured_output", "must be a StructuredOutput")
            if self.min_tokens:  # it would block the end token where the grammar allows only that
                raise bad("min_tokens", "cannot be combined with structured outputs")

    @property
    def needs_every_prompt_position(self) -> bool:
        """Prompt logprobs and mean pooling read every prompt position's hidden state: such a
        request takes no prefix-cache hits (and no remote prefill)."""
        return self.prompt_logprobs is not None or self.pooling == "mean"

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
