"""The model runner's side of LoRA: slots attached to every targetable linear of the model, the
adapters held in host memory (the scheduler decides which: slots.py), and adapters copied into
slots before the step that first uses them."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from engine.kernels.cpu_ops import load_cpu_ops
from engine.lora.adapter import AdapterWeights, read_adapter
from engine.lora.batch import NO_SLOT, LoRABatch
from engine.lora.config import LoRAConfig
from engine.lora.layer import LoRASlots
from engine.lora.request import LoRARequest

if TYPE_CHECKING:
    from engine.core.scheduler_output import SchedulerOutput

# module name -> (the layer's linear, as a path from the decoder layer; the piece's shard id)
_PLACES: dict[str, tuple[str, str, int | str | None]] = {
    "q_proj": ("self_attn", "qkv_proj", "q"),
    "k_proj": ("self_attn", "qkv_proj", "k"),
    "v_proj": ("self_attn", "qkv_proj", "v"),
    "o_proj": ("self_attn", "o_proj", None),
    "gate_proj": ("mlp", "gate_up_proj", 0),
    "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", None),
}
_SHARDS = {"qkv_proj": ["q", "k", "v"], "o_proj": [None], "gate_up_proj": [0, 1], "down_proj": [None]}


class ModelLoRA:
    def __init__(self, model: torch.nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.config, self.dtype = config, dtype
        # (layer index, fused linear name) -> its slots
        self.slots: dict[tuple[int, str], LoRASlots] = {}
        for i, layer in enumerate(model.model.layers):
            for parent, name in (
                ("self_attn", "qkv_proj"),
                ("self_attn", "o_proj"),
                ("mlp", "gate_up_proj"),
                ("mlp", "down_proj"),
            ):
                linear = getattr(getattr(layer, parent), name, None)
                if linear is None:
                    continue  # a mixture-of-experts MLP: adapters targeting it are refused (adapter.py)
                s = LoRASlots(linear, _SHARDS[name], config.max_loras, config.max_lora_rank, dtype, device)
                linear.lora = s
                self.slots[(i, name)] = s
        self.host: OrderedDict[str, AdapterWeights] = OrderedDict()  # cache key -> weights, as the scheduler keeps them
        # The C++ per-row op (engine/kernels/cpu/lora_bgmv.cpp) for the steps it wins (batch.py);
        # a generic build (no AVX2) has the module but declines the op.
        ops = load_cpu_ops() if device.type == "cpu" else None
        self.bgmv = ops is not None and ops.isa() != "generic"

    def apply(self, so: SchedulerOutput) -> None:
        """Before the step: forget the adapters the scheduler evicted from host memory, then
        copy the adapters it placed into their slots (reading them from disk when not held)."""
        for name in so.lora_evictions:
            self.host.pop(name, None)
        for slot, lora in so.lora_loads.items():
            self.load(slot, lora)

    def load(self, slot: int, lora: LoRARequest | None) -> None:
        """Put `lora` in `slot` (None: empty it). Each linear's `set_slot` empties its slot before
        writing; an adapter that fails to read empties the slot too, so none is left stale."""
        if lora is None:
            self._clear(slot)
            return
        weights = self.host.get(lora.cache_key)
        if weights is None:
            try:
                weights = self.host[lora.cache_key] = read_adapter(lora, self.dtype)
            except BaseException:
                self._clear(slot)
                raise
        by_linear: dict[tuple[int, str], dict] = {}
        for (layer, module), ab in weights.items():
            _, name, shard = _PLACES[module]
            by_linear.setdefault((layer, name), {})[shard] = ab
        for key, s in self.slots.items():
            s.set_slot(slot, by_linear.get(key, {}))

    def _clear(self, slot: int) -> None:
        for s in self.slots.values():
            s.clear_slot(slot)

    def batch(self, slots: list[int], starts: list[int], counts: list[int], device: torch.device) -> LoRABatch | None:
        if all(s == NO_SLOT for s in slots):
            return None
        return LoRABatch.build(slots, starts, counts, device, self.config.max_loras, self.bgmv)
