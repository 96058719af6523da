"""Which LoRA adapters the worker holds, and which of them sit in its `max_loras` device slots.

    registry (host memory)      name -> LoraAdapter           every adapter loaded, any number
    slots (device weights)      [ a@1 | b@7 | -- | c@3 ]      at most max_loras, `stacks` holds them
    pins                        [  2  |  0  |  0 |  1  ]      running samples using each slot
    LRU (oldest first)          b@7, c@3, a@1                 occupied slots by last acquire

`acquire(name)` gives the slot of a resident adapter (and marks it used), or copies the adapter
into a free slot, or into the least recently used UNPINNED slot; None when every slot is pinned:
the request waits, an adapter in use is never evicted. A caller pins the slot while a sample
runs on it and unpins it when the sample finishes, is preempted or aborted.

`add` of a name already held with other weights (another identity) and `remove` take the old
adapter out of the registry at once; its slot stays with it, pinned, until its last running
sample unpins it, then it is cleared. An `add` of the same identity (the same weights again)
keeps the slot. Nothing here knows of requests or of the cache: the engine keeps those.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from worker.lora_adapter import AdapterError, LoraAdapter

SWAP_EWMA_WEIGHT = 0.2
"""Weight of the newest swap in the swap-time average."""


class SlotWeights(Protocol):
    """The device side of the slots (`worker.lora_weights.LoraStacks`)."""

    def load(self, slot: int, adapter: LoraAdapter) -> None: ...

    def clear(self, slot: int) -> None: ...


@dataclass(frozen=True, slots=True)
class AdapterState:
    """One registered adapter, as reported (`Load.adapters`)."""

    name: str
    identity: str
    rank: int
    target_modules: tuple[str, ...]
    path: str
    slot: int | None
    """The device slot holding it; None: in host memory only."""
    pins: int

    @property
    def resident(self) -> bool:
        return self.slot is not None


class AdapterSlots:
    def __init__(
        self,
        max_loras: int,
        max_rank: int,
        stacks: SlotWeights | None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if max_loras < 0 or max_rank < 1:
            raise ValueError(f"max_loras must be >= 0 and max_rank >= 1: {max_loras}, {max_rank}")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.stacks = stacks
        self.clock = clock
        self.adapters: dict[str, LoraAdapter] = {}
        """The registry: every adapter loaded, by name (read from any thread; changed only on
        the engine's)."""
        self._slots: list[LoraAdapter | None] = [None] * max_loras
        self._pins = [0] * max_loras
        self._where: dict[str, int] = {}
        """identity -> slot, for every occupied slot."""
        self._lru: OrderedDict[int, None] = OrderedDict()
        """Occupied slots, least recently acquired first."""
        self.swaps = 0
        """Adapters copied into a slot since creation."""
        self.swap_seconds = 0.0
        """Average time of one copy into a slot (EWMA; 0 before the first)."""
        self.swap_seconds_total = 0.0

    # -- the registry --------------------------------------------------------------------------
    def get(self, name: str) -> LoraAdapter | None:
        return self.adapters.get(name)

    def add(self, adapter: LoraAdapter) -> LoraAdapter | None:
        """Register `adapter`, replacing one of the same name; returns the one replaced (None if
        there was none). Other weights under the same name retire the old slot (see above)."""
        if adapter.rank > self.max_rank:
            raise AdapterError(
                f"{adapter.path}: rank {adapter.rank} is above max_lora_rank {self.max_rank}"
            )
        if self.max_loras == 0:
            raise AdapterError(f"{adapter.path}: this worker has max_loras = 0 (no adapter slots)")
        old = self.adapters.get(adapter.name)
        self.adapters[adapter.name] = adapter
        slot = self._where.get(adapter.identity)
        if slot is not None:  # the same weights (or a retiring copy of them): keep the slot
            self._slots[slot] = adapter
        if old is not None and old.identity != adapter.identity:
            self._retire(old)
        return old

    def remove(self, name: str) -> LoraAdapter:
        """Take `name` out of the registry (KeyError if unknown); its slot is freed once no
        running sample pins it."""
        adapter = self.adapters.pop(name)
        self._retire(adapter)
        return adapter

    def _retire(self, adapter: LoraAdapter) -> None:
        slot = self._where.get(adapter.identity)
        if slot is not None and self._pins[slot] == 0:
            self._free(slot)

    def _registered(self, adapter: LoraAdapter) -> bool:
        current = self.adapters.get(adapter.name)
        return current is not None and current.identity == adapter.identity

    # -- slots ---------------------------------------------------------------------------------
    def acquire(self, name: str) -> int | None:
        """The slot holding `name`'s adapter, loading it into a free or the least recently used
        unpinned slot if needed; None when every slot is pinned. KeyError if `name` is not
        registered."""
        adapter = self.adapters[name]
        slot = self._where.get(adapter.identity)
        if slot is not None:
            self._lru.move_to_end(slot)
            return slot
        slot = next((s for s, held in enumerate(self._slots) if held is None), None)
        if slot is None:
            slot = next((s for s in self._lru if self._pins[s] == 0), None)
            if slot is None:
                return None
            self._free(slot, clear=False)  # overwritten below
        began = self.clock()
        if self.stacks is not None:
            self.stacks.load(slot, adapter)
        elapsed = self.clock() - began
        self.swap_seconds = (
            elapsed
            if not self.swaps
            else (1 - SWAP_EWMA_WEIGHT) * self.swap_seconds + SWAP_EWMA_WEIGHT * elapsed
        )
        self.swaps += 1
        self.swap_seconds_total += elapsed
        self._slots[slot] = adapter
        self._where[adapter.identity] = slot
        self._lru[slot] = None
        return slot

    def pin(self, slot: int) -> None:
        """A sample runs on `slot`: it may not be reassigned until unpinned."""
        if self._slots[slot] is None:
            raise ValueError(f"pin of slot {slot}, which holds no adapter")
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        """One sample on `slot` ended; a retired adapter's slot is freed with its last pin."""
        if self._pins[slot] <= 0:
            raise ValueError(f"unpin of slot {slot}, which holds no pin")
        self._pins[slot] -= 1
        adapter = self._slots[slot]
        if self._pins[slot] == 0 and adapter is not None and not self._registered(adapter):
            self._free(slot)

    def _free(self, slot: int, clear: bool = True) -> None:
        adapter = self._slots[slot]
        assert adapter is not None and self._pins[slot] == 0
        del self._where[adapter.identity]
        del self._lru[slot]
        self._slots[slot] = None
        if clear and self.stacks is not None:
            self.stacks.clear(slot)

    # -- views ---------------------------------------------------------------------------------
    def slot_of(self, identity: str) -> int | None:
        return self._where.get(identity)

    def holder(self, slot: int) -> LoraAdapter | None:
        """The adapter whose weights `slot` holds (None: empty)."""
        return self._slots[slot]

    def pins(self, slot: int) -> int:
        return self._pins[slot]

    def lru_order(self) -> list[int]:
        """Occupied slots, least recently acquired first."""
        return list(self._lru)

    def resident(self) -> list[str]:
        """Names of the registered adapters that sit in a slot (safe from any thread: the
        registry is copied in one step first)."""
        return [a.name for a in list(self.adapters.values()) if a.identity in self._where]

    def info(self) -> list[AdapterState]:
        """Every registered adapter, by name."""
        out = []
        for name in sorted(self.adapters):
            adapter = self.adapters[name]
            slot = self._where.get(adapter.identity)
            out.append(
                AdapterState(
                    name,
                    adapter.identity,
                    adapter.rank,
                    adapter.target_modules,
                    adapter.path,
                    slot,
                    self._pins[slot] if slot is not None else 0,
                )
            )
        return out
