"""Where each object stands in its listing, and where those last deleted or forgotten stood, so
that a client paging a list while it deletes what it read goes on from there: the SDKs ask for
the next page after the last id of the one before, which that client has just deleted
(`for f in client.files.list(): client.files.delete(f.id)`, and the same over Anthropic's
Message Batches).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import count
from typing import Protocol, TypeVar

from cluster.http.errors import HttpError

MAX_GONE = 4096
"""Ids gone whose place is remembered, every tenant's together: past it, the tenant with the
most remembered forgets its least recent, so one tenant deleting much forgets its own."""


class ListPlaces:
    """Places by (tenant, id), drawn in the order the objects were added (ascending), for a
    store whose listing is in that order. Used from the router's event loop only."""

    def __init__(self) -> None:
        self._draw = count()
        self._kept: dict[tuple[str, str], int] = {}
        self._gone: dict[str, OrderedDict[str, int]] = {}
        """Tenant -> id gone -> its place, least recent first."""
        self._gone_count = 0

    def add(self, tenant: str, key: str, place: int | None = None) -> None:
        """An object added, after every one there is (or at `place`, for a store whose order
        is drawn elsewhere); one kept already keeps its place."""
        if (tenant, key) not in self._kept:
            self._kept[tenant, key] = next(self._draw) if place is None else place
            self._forget(tenant, key)

    def remove(self, tenant: str, key: str) -> None:
        """An object gone: its place is remembered (MAX_GONE)."""
        place = self._kept.pop((tenant, key), None)
        if place is None:
            return
        self._gone.setdefault(tenant, OrderedDict())[key] = place
        self._gone_count += 1
        if self._gone_count > MAX_GONE:
            most = max(self._gone, key=lambda owner: len(self._gone[owner]))
            self._forget(most, next(iter(self._gone[most])))

    def _forget(self, tenant: str, key: str) -> None:
        gone = self._gone.get(tenant)
        if gone is None or gone.pop(key, None) is None:
            return
        self._gone_count -= 1
        if not gone:
            del self._gone[tenant]

    def place(self, tenant: str, key: str) -> int | None:
        """The object's place, kept or recently gone (None: unknown)."""
        found = self._kept.get((tenant, key))
        if found is not None:
            return found
        gone = self._gone.get(tenant)
        return gone.get(key) if gone is not None else None


class Listed(Protocol):
    @property
    def id(self) -> str: ...


T = TypeVar("T", bound=Listed)


def past(
    items: Sequence[T],
    name: str,
    given: str,
    place_of: Callable[[str], int | None],
    newer: bool,
) -> list[T]:
    """The items past the one `given` names (query parameter `name`), kept or gone: the newer
    ones (`newer`) or the older, in `items`' order; an id never listed is refused by name."""
    at = place_of(given)
    if at is None:
        raise HttpError.invalid(name, f"{given!r} is not in the list")
    places = [place_of(item.id) for item in items]
    return [
        item
        for item, place in zip(items, places, strict=True)
        if place is not None and place != at and (place > at) is newer
    ]
