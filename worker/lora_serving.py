"""The engine's adapter lifecycle: names to identities, loading, unloading, and dropping the
cached trees of adapters that are gone.

    submit (any thread)   bind: namespace.adapter "caps" -> "caps@1f2e..." (the identity: name
                          and weights digest), or InvalidRequest naming it and the loaded ones
    load (caller thread)  read: the PEFT directory, checked against the model (AdapterError)
         (engine thread)  install: into the registry; other weights under a loaded name retire
                          the old identity
    unload (engine)       out of the registry: the scheduler refuses its queued samples, its
                          running ones finish on their pinned slot
    retired identities    their trees (every tenant's) are dropped from the cache as soon as no
                          live sequence runs in them; the same weights loaded again keep theirs

The registry and the slots are `AdapterSlots`; the cache never sees an adapter's name.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from cache import SequenceCache
from worker.config import ModelConfig
from worker.errors import InvalidRequest
from worker.lora_adapter import LoraAdapter, load_adapter
from worker.lora_slots import AdapterSlots, AdapterState
from worker.lora_weights import LoraStacks
from worker.model import CausalLM
from worker.request import GenerateRequest

log = logging.getLogger(__name__)


def adapter_slots(
    model: CausalLM, max_loras: int, max_rank: int
) -> tuple[AdapterSlots, LoraStacks | None]:
    """Slots for `model` and their device stacks, on its device in its dtype (no stacks:
    max_loras 0)."""
    weight = model.model.embed_tokens.weight
    stacks = None
    if max_loras:
        stacks = LoraStacks(model.config, max_loras, max_rank, weight.device, model.dtype)
    return AdapterSlots(max_loras, max_rank, stacks), stacks


class AdapterLifecycle:
    def __init__(
        self, slots: AdapterSlots, cache: SequenceCache, config: ModelConfig, max_rank: int
    ) -> None:
        self.slots = slots
        self.cache = cache
        self.config = config
        self.max_rank = max_rank
        self.retired: set[str] = set()
        """Identities of unloaded or replaced adapters whose trees are still to be dropped."""

    def loaded(self) -> str:
        return ", ".join(sorted(self.slots.adapters)) or "none"

    # -- any thread ----------------------------------------------------------------------------
    def bind(self, request: GenerateRequest) -> tuple[GenerateRequest, LoraAdapter | None]:
        """The request in its adapter's namespace (the name swapped for the identity)."""
        name = request.namespace.adapter
        if name is None:
            return request, None
        adapter = self.slots.get(name)
        if adapter is None:
            raise InvalidRequest(
                "namespace.adapter", f"unknown adapter {name!r} (loaded: {self.loaded()})"
            )
        namespace = replace(request.namespace, adapter=adapter.identity)
        return replace(request, namespace=namespace), adapter

    def read(self, name: str, path: str) -> LoraAdapter:
        """Read and check a PEFT directory (file reads: never on the engine thread)."""
        return load_adapter(name, path, self.config, self.max_rank)

    # -- the engine thread ---------------------------------------------------------------------
    def install(self, adapter: LoraAdapter) -> AdapterState:
        old = self.slots.add(adapter)
        self.retired.discard(adapter.identity)  # its trees hold KV of exactly these weights
        if old is not None and old.identity != adapter.identity:
            self.retired.add(old.identity)
            self.drop_retired()
        log.info("adapter %s loaded (rank %d, %s)", adapter.identity, adapter.rank, adapter.path)
        (state,) = [s for s in self.slots.info() if s.name == adapter.name]
        return state

    def unload(self, name: str) -> int:
        """Take `name` out of service; returns the cached pages dropped now. KeyError if
        `name` is not loaded."""
        if name not in self.slots.adapters:
            raise KeyError(f"adapter {name!r} is not loaded (loaded: {self.loaded()})")
        adapter = self.slots.remove(name)
        self.retired.add(adapter.identity)
        freed = self.drop_retired()
        log.info("adapter %s unloaded; %d cached pages dropped", adapter.identity, freed)
        return freed

    def drop_retired(self) -> int:
        """Drop the trees of retired adapters that no live sequence uses any more; returns
        the device pages freed."""
        if not self.retired:
            return 0
        busy = {seq.namespace.adapter for seq in self.cache.live}
        ready = self.retired - busy
        if not ready:
            return 0
        self.retired -= ready
        return self.cache.drop_namespaces(lambda namespace: namespace.adapter in ready)

    def why_gone(self, adapter: LoraAdapter) -> str:
        """Why a request of `adapter` cannot go on (the scheduler refused it)."""
        if adapter.name in self.slots.adapters:
            return f"adapter {adapter.name!r} was replaced after the request began"
        return f"adapter {adapter.name!r} was unloaded"
