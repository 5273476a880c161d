"""A pool's LoRA adapters as its router replica knows them (engine/lora/): `lora_modules` from the
config, then `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's routes and bodies).
Clients name an adapter as the OpenAI `model` or TGI's `adapter_id`; each request carries its
LoRARequest (name and directory) to the engine replica, which checks it once and loads it into
a slot when a step first needs it, so every replica of the pool serves every adapter named here
without being told, a request moved to another replica keeps its adapter, and an unloaded
adapter leaves the replicas' host memory as their LRU evicts it.

The names live in this router replica: with several router replicas, load and unload on each.
With several model pools, the routes change the first pool's adapters (`lora_modules` in a
pool's config names its own).
"""

from __future__ import annotations

import itertools
import os

from pydantic import BaseModel, ConfigDict, Field

from engine.errors import AdapterNotFoundError, InvalidRequestError
from engine.lora.adapter import check_adapter
from engine.lora.request import LoRARequest
from router.ingress.errors import parse_body


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, description="The name clients will pass as `model` / `adapter_id`.")
    lora_path: str = Field(min_length=1, description="A PEFT adapter directory on the serving nodes.")


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, description="An adapter loaded before (or named in lora_modules).")


class LoRAAdapters:
    def __init__(self, base_name: str, hf_config: object, max_lora_rank: int, modules: dict[str, str] | None) -> None:
        self.base_name, self.hf_config, self.max_lora_rank = base_name, hf_config, max_lora_rank
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        for name, path in (modules or {}).items():
            self.load(name, path)

    def get(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name) if name else None

    def load(self, name: str, path: str) -> LoRARequest:
        if name in self.adapters or name == self.base_name:
            raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        lora = LoRARequest(name, next(self._ids), path)
        # Checked here when the directory is readable here (the replicas check it again).
        if os.path.isdir(lora.lora_path):
            check_adapter(lora, self.hf_config, self.max_lora_rank)
        self.adapters[name] = lora
        return lora

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise AdapterNotFoundError(f"The lora adapter '{name}' cannot be found.", param="lora_name")

    def http_load(self, body: dict) -> str:
        req = parse_body(LoadLoRAAdapterRequest, body)
        self.load(req.lora_name, req.lora_path)
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    def http_unload(self, body: dict) -> str:
        req = parse_body(UnloadLoRAAdapterRequest, body)
        self.unload(req.lora_name)
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
