"""What the router keeps for the HTTP API's stored objects (the Responses API's responses, the
stored chat completions): each its tenant's, by id, within one bound in bytes, the least
recently stored or read dropped first. Nothing survives a restart of the router.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar


class Sized(Protocol):
    @property
    def size(self) -> int:
        """The bytes it counts against the store's bound."""
        ...


V = TypeVar("V", bound=Sized)


class KeptStore(Generic[V]):
    """Kept objects by (tenant, id), least recently used dropped first beyond `max_bytes`.
    Used from the router's event loop only."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._kept: OrderedDict[tuple[str, str], tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def put(self, tenant: str, key: str, value: V) -> bool:
        """Keep `value` (replacing the tenant's of that id), dropping the least recently used
        until it fits; False, keeping nothing new, when it is larger than the whole store (the
        id's older one is gone all the same: the id is the new one's)."""
        self.delete(tenant, key)  # an id used again: the older one goes
        size = value.size
        if size > self.max_bytes:
            return False
        while self.bytes + size > self.max_bytes:
            (owner, old), (dropped, taken) = self._kept.popitem(last=False)
            self.bytes -= taken
            self.gone(owner, old, dropped)
        self._kept[tenant, key] = (value, size)
        self.bytes += size
        return True

    def get(self, tenant: str, key: str) -> V | None:
        """The tenant's object of that id (None: never stored, deleted or dropped), now the
        most recently used."""
        kept = self._kept.get((tenant, key))
        if kept is None:
            return None
        self._kept.move_to_end((tenant, key))
        return kept[0]

    def delete(self, tenant: str, key: str) -> bool:
        kept = self._kept.pop((tenant, key), None)
        if kept is None:
            return False
        self.bytes -= kept[1]
        self.gone(tenant, key, kept[0])
        return True

    def gone(self, tenant: str, key: str, value: V) -> None:
        """Told of each object deleted, replaced or dropped (nothing here)."""

    def of(self, tenant: str) -> Iterator[tuple[str, V]]:
        """The tenant's ids and objects, least recently used first (none made more recent)."""
        for (owner, key), (value, _) in self._kept.items():
            if owner == tenant:
                yield key, value
