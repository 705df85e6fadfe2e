"""LoRA slots and the host-memory cache behind them: LRU replacement, cold loads, busy slots never taken."""

import pytest

from modelserver.engine.lora import LoRAError, LoRASlots


def slots(max_loras, max_cpu_loras, names="abcde"):
    s = LoRASlots(max_loras, max_cpu_loras)
    for name in names:
        s.add(name, f"/{name}")
    return s


@pytest.mark.parametrize(
    ("max_loras", "max_cpu_loras", "uses", "cold"),
    [
        (1, 1, "aaa", [1, 0, 0]),  # stays in its slot: loaded once
        (1, 1, "aba", [1, 1, 1]),  # one slot, one host copy: every switch reads storage
        (1, 2, "aba", [1, 1, 0]),  # a is still in host memory when it comes back
        (1, 2, "abca", [1, 1, 1, 1]),  # c evicted a (least recently used) from host memory
        (2, 2, "abab", [1, 1, 0, 0]),  # both fit in the slots
        (1, 3, "abcab", [1, 1, 1, 0, 0]),
    ],
)
def test_cold_loads_follow_the_host_memory_lru(max_loras, max_cpu_loras, uses, cold):
    s = slots(max_loras, max_cpu_loras)
    seen = []
    for name in uses:
        assert s.slot_for(name, busy=set()) is not None
        _, num_cold = s.take_pending_loads()
        seen.append(num_cold)
    assert seen == cold
    assert len(s.cpu_adapters) <= max_cpu_loras


def test_slot_replacement_takes_the_least_recently_used_idle_adapter():
    s = slots(2, 4)
    assert s.slot_for("a", set()) == 1
    assert s.slot_for("b", set()) == 2
    s.slot_for("a", set())  # a used again: b is now the least recently used
    assert s.slot_for("c", set()) == 2
    loads, _ = s.take_pending_loads()
    assert loads == {1: ("a", "/a"), 2: ("c", "/c")}


def test_a_busy_adapter_keeps_its_slot():
    s = slots(1, 1)
    s.slot_for("a", set())
    assert s.slot_for("b", busy={"a"}) is None
    assert s.slot_for("b", busy=set()) == 1


def test_an_adapter_in_a_slot_stays_in_host_memory():
    s = slots(2, 2)
    s.slot_for("a", set())
    s.slot_for("b", set())
    s.slot_for("c", busy={"a"})  # replaces b in slot 2; a (in a slot) must not leave host memory
    assert set(s.cpu_adapters) == {"a", "c"}


def test_registry_errors():
    s = slots(1, 1, names="a")
    with pytest.raises(LoRAError):
        s.add("a", "/again")
    with pytest.raises(KeyError):
        s.remove("missing")
    s.slot_for("a", set())
    s.remove("a")
    assert s.cpu_adapters == []
    s.add("z", "/z")
    assert s.slot_for("z", set()) == 1  # the removed adapter's slot is free again
