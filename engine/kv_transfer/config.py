"""Which side of a disaggregated deployment an engine is, and when decode prefills itself."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class KVTransferConfig:
    """`role="decode"`: new requests whose uncached prompt is longer than `local_prefill_max_tokens`
    wait for their KV from a prefill engine (the caller moves it); shorter ones are prefilled here
    (conditional disaggregation). `role="prefill"`: requests may ask to have their KV read out
    when they finish. Colocated engines have no KVTransferConfig."""

    role: str
    local_prefill_max_tokens: int = 64

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidRequestError(f"kv role must be one of {ROLES}, got {self.role!r}")
        if self.local_prefill_max_tokens < 0:
            raise InvalidRequestError("local_prefill_max_tokens must be >= 0")

    @classmethod
    def from_value(cls, value: "KVTransferConfig | dict | None") -> "KVTransferConfig | None":
        if value is None or isinstance(value, KVTransferConfig):
            return value
        return cls(**value)
