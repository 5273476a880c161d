"""The scheduler's side of LoRA: which adapter sits in which of the `max_loras` slots, which
adapters the workers hold in host memory (an LRU of `max_cpu_loras`), and which slots running
requests pin. The model runner follows the loads and evictions each step carries
(model_lora.py).

A request pins its adapter's slot from the step it is first scheduled until it finishes or is
preempted, so an adapter in use is never evicted from its slot or from host memory. A waiting
request whose adapter can get no slot (every slot pinned by other adapters) is passed over this
step; the pins are released as running requests end, so it is never starved for good.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.lora.batch import NO_SLOT
from engine.lora.config import LoRAConfig
from engine.lora.request import LoRARequest


class AdapterSlots:
    def __init__(self, config: LoRAConfig) -> None:
        self.config = config
        # Adapters are keyed by LoRARequest.cache_key (name and directory): a name loaded again
        # from another directory is another adapter.
        self.slots: list[str | None] = [None] * config.max_loras  # adapter key in each slot
        self.slot_of: dict[str, int] = {}
        self.host: OrderedDict[str, LoRARequest] = OrderedDict()  # held by the workers, LRU first
        self.holders: dict[str, str] = {}  # request id -> adapter key it pins
        self.pins: dict[str, int] = {}  # adapter key -> requests pinning it
        self.loads: dict[int, LoRARequest | None] = {}  # slot -> adapter, since the last step
        self.evictions: list[str] = []  # adapter keys dropped from host memory since the last step
        self.num_loads = 0  # adapters read from disk into host memory
        self.num_evictions = 0  # adapters dropped from host memory

    def slot(self, request_id: str) -> int:
        name = self.holders.get(request_id)
        return NO_SLOT if name is None else self.slot_of[name]

    def acquire(self, request_id: str, lora: LoRARequest) -> int | None:
        """The slot of `lora` for this request, pinned until `release`; None when every slot is
        pinned by other adapters (nothing changes then)."""
        name = lora.cache_key
        if request_id in self.holders:
            return self.slot_of[self.holders[request_id]]
        slot = self.slot_of.get(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            old = self.slots[slot]
            if old is not None:  # leaves its slot, stays in host memory
                del self.slot_of[old]
                self.slots[slot] = None
            self._hold_in_host(lora)
            self.slots[slot], self.slot_of[name] = name, slot
            self.loads[slot] = lora
        self.host.move_to_end(name)
        self.holders[request_id] = name
        self.pins[name] = self.pins.get(name, 0) + 1
        return slot

    def release(self, request_id: str) -> None:
        name = self.holders.pop(request_id, None)
        if name is not None:
            self.pins[name] -= 1
            if not self.pins[name]:
                del self.pins[name]

    def _free_slot(self) -> int | None:
        """An empty slot, else the slot of the least recently used unpinned adapter."""
        if None in self.slots:
            return self.slots.index(None)
        for name in self.host:  # least recently used first
            if name in self.slot_of and name not in self.pins:
                return self.slot_of[name]
        return None

    def _hold_in_host(self, lora: LoRARequest) -> None:
        """With one slot free for it: the least recently used adapters outside the slots leave
        host memory until it fits (max_cpu_loras >= max_loras, so there is one)."""
        if lora.cache_key in self.host:
            return
        while len(self.host) >= self.config.max_cpu_loras:
            self._drop(next(n for n in self.host if n not in self.slot_of))
        self.host[lora.cache_key] = lora
        self.num_loads += 1

    def _drop(self, name: str) -> None:
        del self.host[name]
        self.evictions.append(name)
        self.num_evictions += 1
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self.slots[slot] = None
            self.loads[slot] = None

    def in_use(self, lora: LoRARequest) -> bool:
        return lora.cache_key in self.pins

    def forget(self, lora: LoRARequest) -> None:
        """An adapter unloaded from the engine (not in use): out of its slot and host memory."""
        assert lora.cache_key not in self.pins, lora
        if lora.cache_key in self.host:
            self._drop(lora.cache_key)

    def unplace(self, loads: dict[int, LoRARequest | None]) -> None:
        """A step carrying these loads failed (a worker could not read an adapter): adapters no
        running request pins leave their slots and host memory, so the next use loads them
        afresh rather than trusting a slot whose copy may never have happened."""
        for lora in loads.values():
            if lora is not None and lora.cache_key not in self.pins and lora.cache_key in self.host:
                self._drop(lora.cache_key)

    def take_changes(self) -> tuple[dict[int, LoRARequest | None], list[str]]:
        """The slot loads (None: cleared) and host evictions for the next step, in order:
        evictions first, then loads."""
        loads, evictions = self.loads, self.evictions
        self.loads, self.evictions = {}, []
        return loads, evictions

    def loaded(self) -> list[str]:
        """The names of the adapters held in host memory, least recently used first."""
        return [lora.lora_name for lora in self.host.values()]
