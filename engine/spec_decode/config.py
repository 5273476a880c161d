"""SpeculativeConfig: the frozen inner form of `EngineArgs.speculative_config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError

METHODS = ("ngram",)  # "draft" and "self" slot in as further Proposer implementations


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3  # upper bound of k; the adaptive policy picks k <= this per step
    prompt_lookup_min: int = 2  # shortest suffix n-gram that may match
    prompt_lookup_max: int = 5  # longest suffix n-gram tried first
    adaptive: bool = True  # k from measured acceptance and the verify-step cost model

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

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A dict (`{"method": "ngram", "num_speculative_tokens": 4, ...}`), a CLI string
        (`"ngram:4"`), a config, or None (speculation off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            method, _, k = value.partition(":")
            return cls(method=method, **({"num_speculative_tokens": int(k)} if k else {}))
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise InvalidRequestError(f"unknown speculative_config keys: {sorted(unknown)}")
            return cls(**value)
        raise InvalidRequestError(f"speculative_config must be a dict or 'method:k', got {type(value).__name__}")
