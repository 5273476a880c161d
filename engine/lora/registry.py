"""The adapters an engine knows by name: those of `lora_modules` at start, those loaded at run time
(`load_lora_adapter`), and those a request brings (the offline API's `lora_request`). Each is
checked against the model when it is added (adapter.py), so a bad directory fails there, not in
a step."""

from __future__ import annotations

import itertools

from engine.errors import AdapterNotFoundError, InvalidRequestError
from engine.lora.adapter import check_adapter
from engine.lora.config import LoRAConfig
from engine.lora.request import LoRARequest


class AdapterRegistry:
    def __init__(self, config: LoRAConfig, hf_config: object, base_name: str) -> None:
        self.config, self.hf_config, self.base_name = config, hf_config, base_name
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._checked: set[str] = set()  # cache keys of adapters checked already

    def add(self, lora: LoRARequest) -> LoRARequest:
        """Add `lora` (checked); adding the same name and directory again is a no-op."""
        known = self.adapters.get(lora.lora_name)
        if known is not None:
            if known.lora_path != lora.lora_path:
                raise InvalidRequestError(
                    f"LoRA adapter {lora.lora_name!r} is already loaded from {known.lora_path}; unload it first"
                )
            return known
        if lora.lora_name == self.base_name:
            raise InvalidRequestError(f"{lora.lora_name!r} is the base model's name")
        self.adapters[lora.lora_name] = self.check(lora)
        return lora

    def check(self, lora: LoRARequest) -> LoRARequest:
        """Check an adapter against the model once, without naming it here (a serving replica
        takes the adapters its router names, router/ingress/lora_adapters.py)."""
        if lora.cache_key not in self._checked:
            check_adapter(lora, self.hf_config, self.config.max_lora_rank)
            self._checked.add(lora.cache_key)
        return lora

    def add_path(self, name: str, path: str) -> LoRARequest:
        known = self.adapters.get(name)
        lora_id = known.lora_int_id if known is not None else self._next_id()
        return self.add(LoRARequest(name, lora_id, path))

    def _next_id(self) -> int:
        used = {a.lora_int_id for a in self.adapters.values()}
        return next(i for i in self._ids if i not in used)

    def resolve(self, lora: LoRARequest | str | None) -> LoRARequest | None:
        """A request's adapter: a name must be known; a LoRARequest is added when it is not."""
        if lora is None:
            return None
        if isinstance(lora, str):
            if lora not in self.adapters:
                raise AdapterNotFoundError(f"the LoRA adapter {lora!r} does not exist", param="model")
            return self.adapters[lora]
        return self.add(lora)

    def remove(self, name: str) -> LoRARequest:
        if name not in self.adapters:
            raise AdapterNotFoundError(f"the LoRA adapter {name!r} does not exist", param="lora_name")
        return self.adapters.pop(name)

    def list(self) -> list[LoRARequest]:
        return list(self.adapters.values())
