"""LoRA adapters: the registry of known adapters, the GPU slots a batch can use (`--max-loras`) and the host-memory
cache behind them (`--max-cpu-loras`), both least-recently-used.

Slot 0 means "no adapter"; slots 1..max_loras hold adapters, and the least recently used idle one is replaced when
another adapter needs a slot. An adapter entering a slot is read from host memory when it is among the
`max_cpu_loras` most recently used adapters, otherwise from storage first (a cold load, which costs more). The
registry itself keeps every adapter that was added until it is removed, like vLLM's served LoRA modules.
"""

from __future__ import annotations

from collections import OrderedDict


class LoRAError(ValueError):
    pass


class LoRASlots:
    def __init__(self, max_loras: int, max_cpu_loras: int | None = None):
        self.max_loras = max_loras
        self.max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        self.adapters: OrderedDict[str, str] = OrderedDict()  # name -> path, in LRU order (last = newest use)
        # name -> integer id, as vLLM's serving layer numbers adapters: 1, 2, ... in the order they are added
        # (--lora-modules first); a re-added adapter gets a new id. KV events carry it as lora_id.
        self.ids: dict[str, int] = {}
        self._last_id = 0
        self._slot_of: dict[str, int] = {}
        self._free_slots = list(range(max_loras, 0, -1))
        self._cpu: OrderedDict[str, None] = OrderedDict()  # adapters in host memory, LRU order (last = newest)
        self.pending_loads: dict[int, tuple[str, str]] = {}  # slot -> (name, path) for the executor's next step
        self.pending_cold_loads = 0  # how many of pending_loads read the adapter from storage

    def add(self, name: str, path: str) -> None:
        if name in self.adapters:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded.")
        self.adapters[name] = path
        self._last_id += 1
        self.ids[name] = self._last_id

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(name)
        del self.adapters[name]
        del self.ids[name]
        self.evict(name)

    def evict(self, name: str) -> None:
        """Forget that `name` is in a GPU slot or host memory (its load failed): the next use loads it again."""
        self._cpu.pop(name, None)
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._free_slots.append(slot)

    @property
    def cpu_adapters(self) -> list[str]:
        """Adapters in host memory, least recently used first."""
        return list(self._cpu)

    def slot_for(self, name: str, busy: set[str]) -> int | None:
        """The GPU slot holding `name`, loading it (evicting an idle adapter) if needed; None if every slot is busy."""
        slot = self._slot_of.get(name)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                idle = next((n for n in self.adapters if n in self._slot_of and n not in busy), None)
                if idle is None:
                    return None
                slot = self._slot_of.pop(idle)
            self._slot_of[name] = slot
            self.pending_loads[slot] = (name, self.adapters[name])
            self._load_into_host_memory(name)
        else:
            self._cpu.move_to_end(name)
        self.adapters.move_to_end(name)
        return slot

    def _load_into_host_memory(self, name: str) -> None:
        cpu = self._cpu
        if name in cpu:
            cpu.move_to_end(name)
            return
        self.pending_cold_loads += 1
        cpu[name] = None
        if len(cpu) > self.max_cpu_loras:
            # Evict the least recently used adapter that no GPU slot holds (slots are a subset of host memory).
            victim = next((n for n in cpu if n not in self._slot_of), None)
            if victim is not None:
                del cpu[victim]

    def take_pending_loads(self) -> tuple[dict[int, tuple[str, str]], int]:
        """The loads the next step must do first, and how many of them are cold; resets both."""
        loads, cold = self.pending_loads, self.pending_cold_loads
        self.pending_loads, self.pending_cold_loads = {}, 0
        return loads, cold
