"""cluster/http/list_places.py against a model: the ids ever added in order, and which went.
Paging past an id kept or recently gone lists the kept ids added before it (older) or after
it (newer); an id gone longer ago than MAX_GONE, or never added, is refused by name."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.http import list_places
from cluster.http.errors import HttpError
from cluster.http.list_places import ListPlaces, past

GONE = 3

operation = st.tuples(
    st.sampled_from(["add", "remove", "page"]),
    st.sampled_from(["acme", "globex"]),
    st.sampled_from([f"id{i}" for i in range(6)]),
    st.booleans(),
)


@dataclass(frozen=True)
class Item:
    id: str


@settings(max_examples=300, deadline=None)
@given(st.lists(operation, max_size=60))
def test_paging_goes_on_from_where_an_id_stood(
    operations: list[tuple[str, str, str, bool]],
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(list_places, "MAX_GONE", GONE)
        places = ListPlaces()
        added: dict[str, list[str]] = {"acme": [], "globex": []}  # in the order added
        kept: dict[str, set[str]] = {"acme": set(), "globex": set()}
        gone: dict[str, list[str]] = {}  # tenant -> ids gone, least recent first

        def forget(tenant: str, key: str) -> None:
            if key in gone.get(tenant, []):
                gone[tenant].remove(key)
                if not gone[tenant]:
                    del gone[tenant]

        for kind, tenant, key, newer in operations:
            if kind == "add" and key not in kept[tenant]:
                places.add(tenant, key)
                added[tenant] = [k for k in added[tenant] if k != key] + [key]
                kept[tenant].add(key)
                forget(tenant, key)
            elif kind == "remove" and key in kept[tenant]:
                places.remove(tenant, key)
                kept[tenant].discard(key)
                gone.setdefault(tenant, []).append(key)
                if sum(map(len, gone.values())) > GONE:  # the tenant with the most forgets
                    most = max(gone, key=lambda owner: len(gone[owner]))
                    forget(most, gone[most][0])
            elif kind == "page":
                listing = [Item(k) for k in added[tenant] if k in kept[tenant]]
                known = key in kept[tenant] or key in gone.get(tenant, [])
                if not known:
                    with pytest.raises(HttpError, match="after"):
                        past(listing, "after", key, partial(places.place, tenant), newer)
                    continue
                at = added[tenant].index(key)
                side = added[tenant][at + 1 :] if newer else added[tenant][:at]
                got = past(listing, "after", key, partial(places.place, tenant), newer)
                assert [item.id for item in got] == [k for k in side if k in kept[tenant]]


def test_the_last_max_gone_places_are_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(list_places, "MAX_GONE", GONE)
    places = ListPlaces()
    for i in range(GONE + 2):
        places.add("acme", f"id{i}")
    for i in range(GONE + 1):
        places.remove("acme", f"id{i}")
    assert places.place("acme", "id0") is None  # the least recent gone: forgotten
    assert [places.place("acme", f"id{i}") for i in range(1, GONE + 2)] == [1, 2, 3, 4]
    assert places.place("globex", "id4") is None  # another tenant's
    places.add("globex", "g")
    places.remove("globex", "g")  # past the bound: acme, remembering the most, forgets
    assert places.place("globex", "g") == GONE + 2 and places.place("acme", "id1") is None
