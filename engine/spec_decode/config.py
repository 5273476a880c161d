"""SpeculativeConfig: the frozen inner form of `EngineArgs.speculative_config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.choices import SPECULATIVE_METHODS as METHODS
from engine.errors import InvalidRequestError

# ngram: prompt lookup; draft: a smaller local model sharing the tokenizer; self: the target's
# own weights as a cheaper draft (its first `draft_layers` layers, or its weights in int8).


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3  # upper bound of k; the adaptive policy picks k <= this per step
    prompt_lookup_min: int = 2  # shortest suffix n-gram that may match
    prompt_lookup_max: int = 5  # longest suffix n-gram tried first
    adaptive: bool = True  # k from measured acceptance and the verify-step cost model
    model: str | None = None  # draft: a local HF directory or .gguf file (never downloaded)
    draft_layers: int | None = None  # self: the target's first N layers + its final norm and LM head
    # self/draft: the draft's weights quantized. "self" without draft_layers defaults to "int8"
    # (measured: the first layers alone rarely agree with the whole model; docs/speculative-decoding.md).
    draft_quantization: str | None = None
    draft_num_blocks: int | None = None  # the draft's own KV pool (None: as many blocks as the target's)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequestError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise InvalidRequestError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidRequestError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                f"{self.prompt_lookup_max}"
            )
        if self.method == "draft" and not self.model:
            raise InvalidRequestError('speculative method "draft" needs "model": a local HF directory or .gguf file')
        if self.method != "draft" and self.model:
            raise InvalidRequestError(f'"model" is for method "draft", not {self.method!r}')
        if self.draft_layers is not None and (self.method != "self" or self.draft_layers < 1):
            raise InvalidRequestError('"draft_layers" (>= 1) is for method "self"')
        if self.draft_quantization is not None and self.method == "ngram":
            raise InvalidRequestError('"draft_quantization" is for methods "draft" and "self"')
        if self.method == "self" and self.draft_layers is None and self.draft_quantization is None:
            object.__setattr__(self, "draft_quantization", "int8")
        if self.draft_num_blocks is not None and self.draft_num_blocks < 2:
            raise InvalidRequestError(f"draft_num_blocks must be >= 2, got {self.draft_num_blocks}")

    @property
    def uses_draft_model(self) -> bool:
        return self.method in ("draft", "self")

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A dict (`{"method": "ngram", "num_speculative_tokens": 4, ...}`), a CLI string
        (`"ngram:4"`, `"self:4"`, `"draft:4:/path/to/model"`), a config, or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            method, _, rest = value.partition(":")
            k, _, model = rest.partition(":")
            kw: dict[str, Any] = {"num_speculative_tokens": int(k)} if k else {}
            return cls(method=method, **kw, **({"model": model} if model else {}))
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise InvalidRequestError(f"unknown speculative_config keys: {sorted(unknown)}")
            return cls(**value)
        raise InvalidRequestError(f"speculative_config must be a dict or 'method:k', got {type(value).__name__}")
