"""LoRA adapters: the registry of known adapters and the GPU slots a batch can use (`--max-loras`).

Slot 0 means "no adapter"; slots 1..max_loras hold adapters, the least recently used idle one is replaced when
another adapter needs a slot. (`--max-cpu-loras` bounds the torch executor's cache of adapter weights in host
memory; the registry itself keeps every adapter that was loaded until it is unloaded.)"""

from __future__ import annotations

from collections import OrderedDict


class LoRAError(ValueError):
    pass


class LoRASlots:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.adapters: OrderedDict[str, str] = OrderedDict()  # name -> path, in LRU order (last = newest use)
        self._slot_of: dict[str, int] = {}
        self._free_slots = list(range(max_loras, 0, -1))
        self.pending_loads: dict[int, tuple[str, str]] = {}  # slot -> (name, path) for the executor's next step

    def add(self, name: str, path: str) -> None:
        if name in self.adapters:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded.")
        self.adapters[name] = path

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(name)
        del self.adapters[name]
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._free_slots.append(slot)

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
        self.adapters.move_to_end(name)
        return slot

    def take_pending_loads(self) -> dict[int, tuple[str, str]]:
        loads, self.pending_loads = self.pending_loads, {}
        return loads
