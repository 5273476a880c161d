"""What a request carries to name its adapter, with vLLM's class and field names."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter in a local directory (`adapter_config.json` and
    `adapter_model.safetensors`). `lora_name` is how clients address it (the OpenAI `model`,
    TGI's `adapter_id`); `lora_int_id` is a positive number unique per adapter (vLLM's)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        object.__setattr__(self, "lora_path", os.path.abspath(os.fspath(self.lora_path)))

    @property
    def cache_key(self) -> str:
        """The adapter's identity in the prefix cache: its name and directory."""
        return f"{self.lora_name}\x00{self.lora_path}"


def adapter_hash_root(root: int | None, lora: LoRARequest | None) -> int | None:
    """The parent of the first block of a request's hash chain: the engine's own root
    (block_hash.kv_hash_root) for the base model; for an adapter, a digest of that root and the
    adapter's identity, so two adapters never share KV and one adapter always does."""
    if lora is None:
        return root
    h = hashlib.sha256(b"lora\x00")
    h.update(b"\x00" * 32 if root is None else root.to_bytes(32, "big"))
    h.update(lora.cache_key.encode())
    return int.from_bytes(h.digest(), "big")
