"""What the router keeps for the HTTP API's stored objects (the Responses API's responses, the
stored chat completions, the conversations): each its tenant's, by id, within one bound in
bytes. With `router.state_dir`, each object is also written to a file of its own
(cluster/http/kept_files.py) and read back when the router starts again (`restore`); without
it, nothing survives a restart of the router.

When an object needs room, the tenant holding the most bytes (counting the one being kept) gives
up its least recently stored or read object first. So one tenant storing much pushes out its
own objects, not another's, until the tenants hold alike; with one tenant (a router without
API keys) it is a plain least-recently-used store.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from cluster.http.kept_files import KeptFiles

log = logging.getLogger(__name__)


class Sized(Protocol):
    @property
    def size(self) -> int:
        """The bytes it counts against the store's bound."""
        ...


V = TypeVar("V", bound=Sized)


class KeptStore(Generic[V]):
    """Kept objects by (tenant, id) within `max_bytes`, the largest tenant's least recently
    used dropped first (the module docstring). Used from the router's event loop only."""

    def __init__(self, max_bytes: int, directory: Path | None = None) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.files = KeptFiles(directory) if directory is not None and max_bytes > 0 else None
        """Where each object is written too (None: nowhere); read back by `restore`."""
        self._order = 0
        """The next object's place in the order kept, which `restore` keeps them in again."""
        self._restoring = False
        self._kept: dict[str, OrderedDict[str, tuple[V, int]]] = {}
        """Tenant -> id -> (object, its size), least recently used first."""
        self._bytes_of: dict[str, int] = {}
        """Tenant -> the bytes of its objects (no entry: none)."""

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._kept.values())

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def held(self, tenant: str) -> int:
        """The bytes of the tenant's objects."""
        return self._bytes_of.get(tenant, 0)

    def put(self, tenant: str, key: str, value: V) -> bool:
        """Keep `value` (replacing the tenant's of that id), dropping objects until it fits;
        False, keeping nothing new, when it is larger than the whole store (the id's older one
        is gone all the same: the id is the new one's)."""
        self.delete(tenant, key)  # an id used again: the older one goes
        size = value.size
        if size > self.max_bytes:
            return False
        while self.bytes + size > self.max_bytes:
            self._drop_one(tenant, size)
        self._kept.setdefault(tenant, OrderedDict())[key] = (value, size)
        self._bytes_of[tenant] = self._bytes_of.get(tenant, 0) + size
        self.bytes += size
        if self.files is not None and not self._restoring:
            self.files.write(tenant, key, self._order, partial(self.saved, value))
        self._order += 1
        return True

    def _drop_one(self, putting: str, size: int) -> None:
        """Drop the least recently used object of the tenant holding the most, `putting`
        counted with the `size` it is about to add (the first such tenant on a tie)."""
        owner = max(self._bytes_of, key=lambda t: self._bytes_of[t] + (size if t == putting else 0))
        key, (dropped, taken) = self._kept[owner].popitem(last=False)
        self._taken(owner, taken)
        if self.files is not None:
            self.files.remove(owner, key)
        self.gone(owner, key, dropped)

    def _taken(self, tenant: str, size: int) -> None:
        self.bytes -= size
        left = self._bytes_of[tenant] - size
        if self._kept[tenant]:
            self._bytes_of[tenant] = left
        else:
            assert left == 0, f"tenant {tenant!r}: {left} bytes counted with nothing kept"
            del self._bytes_of[tenant], self._kept[tenant]

    def peek(self, tenant: str, key: str) -> V | None:
        """The tenant's object of that id, its use not counted (None: not kept)."""
        kept = self._kept.get(tenant)
        found = kept.get(key) if kept is not None else None
        return found[0] if found is not None else None

    def get(self, tenant: str, key: str) -> V | None:
        """The tenant's object of that id (None: never stored, deleted or dropped), now the
        most recently used."""
        kept = self._kept.get(tenant)
        if kept is None or key not in kept:
            return None
        kept.move_to_end(key)
        return kept[key][0]

    def delete(self, tenant: str, key: str) -> bool:
        kept = self._kept.get(tenant)
        found = kept.pop(key, None) if kept is not None else None
        if found is None:
            return False
        self._taken(tenant, found[1])
        if self.files is not None:
            self.files.remove(tenant, key)
        self.gone(tenant, key, found[0])
        return True

    def gone(self, tenant: str, key: str, value: V) -> None:
        """Told of each object deleted, replaced or dropped (nothing here)."""

    def of(self, tenant: str) -> Iterator[tuple[str, V]]:
        """The tenant's ids and objects, least recently used first (none made more recent)."""
        for key, (value, _) in self._kept.get(tenant, {}).items():
            yield key, value

    # -- on disk (`files`) ----------------------------------------------------------------------
    def saved(self, value: V) -> dict[str, Any]:
        """The object as JSON, for its file (a store kept on disk says how). Called on the
        writer's thread: it only reads the object, which is never changed in place."""
        raise NotImplementedError(f"{type(self).__name__} is not kept on disk")

    def restored(self, saved: dict[str, Any]) -> V:
        """The object its file held (raises if it cannot be one)."""
        raise NotImplementedError(f"{type(self).__name__} is not kept on disk")

    def restore(self) -> int:
        """Read back what a router before this one kept, in the order it was kept (and so
        within the bound as it is now); a file that cannot be read is left out and removed,
        logged. How many objects were read back."""
        if self.files is None:
            return 0
        records = self.files.read_back()
        self._restoring = True
        try:
            for record in records:
                tenant, key = record["tenant"], record["key"]
                try:
                    value = self.restored(record["value"])
                except Exception as err:  # whatever it holds: left out, not fatal
                    log.error("%s %r of %r left out: %s", type(self).__name__, key, tenant, err)
                    self.files.remove(tenant, key)
                    continue
                if not self.put(tenant, key, value):  # larger than the bound is now
                    self.files.remove(tenant, key)
                self._order = max(self._order, record["order"] + 1)
        finally:
            self._restoring = False
        return len(self)

    def close(self) -> None:
        """Write out what waits to be written (blocks: call it off the event loop)."""
        if self.files is not None:
            self.files.close()
