"""The scheduler's adapter slots and host LRU (engine/lora/slots.py), step by step: an adapter in
use is never evicted from its slot or from host memory; the least recently used idle one is."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from engine.lora.config import LoRAConfig
from engine.lora.request import LoRARequest
from engine.lora.slots import AdapterSlots


def _lora(name: str) -> LoRARequest:
    return LoRARequest(name, ord(name), f"/adapters/{name}")


def test_slots_pinned_by_running_requests_are_never_taken():
    s = AdapterSlots(LoRAConfig(max_loras=2, max_cpu_loras=3))
    a, b, c, d = (_lora(n) for n in "abcd")
    assert s.acquire("r1", a) == 0 and s.acquire("r2", b) == 1
    assert s.acquire("r3", a) == 0  # the same adapter shares its slot
    assert s.acquire("r4", c) is None  # both slots pinned: c waits, nothing changed
    assert s.take_changes() == ({0: a, 1: b}, [])
    s.release("r1")
    assert s.in_use(a) and s.acquire("r4", c) is None  # r3 still runs with a
    s.release("r2")  # b idle now
    assert s.acquire("r5", c) == 1  # b's slot: b was the only idle one; a stays
    assert s.loaded() == ["b", "a", "c"]  # least recently used first
    s.release("r5")
    s.release("r3")
    assert s.acquire("r6", b) == 0  # back from host memory into a's slot (a: idle, used before c)
    s.take_changes()
    assert s.acquire("r7", d) == 1  # c's slot; host full (a, c, b): a, in no slot, leaves it
    assert s.take_changes() == ({1: d}, [a.cache_key])
    assert s.loaded() == ["c", "b", "d"] and (s.num_loads, s.num_evictions) == (4, 1)


def test_host_lru_keeps_every_adapter_in_a_slot():
    s = AdapterSlots(LoRAConfig(max_loras=2, max_cpu_loras=2))
    for i, name in enumerate("abcdef"):
        assert s.acquire(f"r{i}", _lora(name)) is not None
        if i:
            s.release(f"r{i - 1}")  # the previous request ends; this one still runs
        assert f"{name}" in s.loaded() and len(s.loaded()) <= 2
        assert set(s.pins) <= set(s.host)  # nothing in use left host memory


def test_forget_and_config_checks():
    s = AdapterSlots(LoRAConfig(max_loras=1))
    s.acquire("r", _lora("a"))
    s.release("r")
    s.forget(_lora("a"))
    assert s.loaded() == [] and s.take_changes() == ({0: None}, [_lora("a").cache_key])
    with pytest.raises(InvalidRequestError, match="max_cpu_loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(InvalidRequestError, match="max_lora_rank"):
        LoRAConfig(max_lora_rank=0)
