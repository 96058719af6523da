"""The pool of KV pages and the state of every page in it.

Every page is in exactly one state, and every transition checks the state it leaves:

    FREE --allocate--> PRIVATE --claim--> CACHED --uncache--> FREE
                          \\------------free_private-----------> FREE

PRIVATE pages belong to one sequence; CACHED pages to one radix-tree node. Page 0 is RESERVED
(the null page that padded page-table entries point at) and never changes state. The pool knows
nothing of trees or sequences; it makes double frees and leaks impossible to miss.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import itemgetter
from typing import Final

from cache.errors import InvalidPageState, OutOfPages

RESERVED: Final = 0
FREE: Final = 1
PRIVATE: Final = 2
CACHED: Final = 3
STATE_NAMES: Final = {RESERVED: "reserved", FREE: "free", PRIVATE: "private", CACHED: "cached"}
NULL_PAGE: Final = 0


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._state = bytearray([FREE]) * num_pages
        self._state[NULL_PAGE] = RESERVED
        # A stack: the most recently freed page is reused first (it is likely still in L2).
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self.num_private = 0
        self.num_cached = 0

    @property
    def usable_pages(self) -> int:
        """Pages that can ever hold KV: all but the null page."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def state(self, page: int) -> int:
        return self._state[page]

    def allocate(self, count: int, evictable: int = 0) -> list[int]:
        """Take `count` free pages, now PRIVATE. `evictable` only informs the error message."""
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({count})")
        if count > len(self._free):
            raise OutOfPages(count, len(self._free), evictable)
        if count == 0:
            return []
        pages = self._free[-count:]
        del self._free[-count:]
        pages.reverse()
        state = self._state
        for page in pages:
            state[page] = PRIVATE
        self.num_private += count
        return pages

    def _move(self, pages: Iterable[int], src: int, dst: int) -> list[int]:
        """Move every page from `src` to `dst`, or none of them (a repeated page is an error)."""
        pages = list(pages)
        if not pages:
            return pages
        state = self._state
        try:
            in_range = min(pages) > 0 and max(pages) < self.num_pages
            states = itemgetter(*pages)(state) if in_range else ()
        except TypeError:
            states = ()
        if len(pages) == 1 and states != ():
            states = (states,)
        if (
            not isinstance(states, tuple)
            or states.count(src) != len(pages)
            or (src != dst and len(set(pages)) != len(pages))
        ):
            raise self._bad_move(pages, src, dst)
        for page in pages:
            state[page] = dst
        return pages

    def _bad_move(self, pages: list[int], src: int, dst: int) -> InvalidPageState:
        seen: set[int] = set()
        for page in pages:
            if type(page) is not int or not 0 <= page < self.num_pages:
                found = "not a page of this pool"
            elif page in seen and src != dst:
                found = "listed twice"
            elif self._state[page] != src:
                found = STATE_NAMES[self._state[page]]
            else:
                seen.add(page)
                continue
            return InvalidPageState(
                f"page {page!r} is {found}, expected {STATE_NAMES[src]} "
                f"(moving {len(pages)} pages to {STATE_NAMES[dst]})"
            )
        raise AssertionError("_bad_move found no bad page")  # pragma: no cover

    def free_private(self, pages: Iterable[int]) -> None:
        """Return a sequence's private pages to the pool."""
        moved = self._move(pages, PRIVATE, FREE)
        self._free.extend(reversed(moved))
        self.num_private -= len(moved)

    def claim(self, pages: Iterable[int]) -> None:
        """Private pages become owned by the cache."""
        moved = self._move(pages, PRIVATE, CACHED)
        self.num_private -= len(moved)
        self.num_cached += len(moved)

    def uncache(self, pages: Iterable[int]) -> None:
        """Cache-owned pages (an evicted node's) return to the pool."""
        moved = self._move(pages, CACHED, FREE)
        self._free.extend(reversed(moved))
        self.num_cached -= len(moved)

    def require(self, pages: Iterable[int], state: int) -> None:
        """Raise `InvalidPageState` unless every page is in `state` (nothing changes)."""
        self._move(pages, state, state)

    def check(self) -> None:
        """Assert the pool's own invariants (counts agree with states; the free list is exact)."""
        counts = {s: 0 for s in STATE_NAMES}
        for s in self._state:
            counts[s] += 1
        assert counts[RESERVED] == 1 and self._state[NULL_PAGE] == RESERVED, "page 0 not reserved"
        assert counts[FREE] == len(self._free) == len(set(self._free)), (
            f"free list has {len(self._free)} entries ({len(set(self._free))} distinct), "
            f"{counts[FREE]} pages are free"
        )
        assert all(self._state[p] == FREE for p in self._free), "a non-free page is on the list"
        assert counts[PRIVATE] == self.num_private, (counts[PRIVATE], self.num_private)
        assert counts[CACHED] == self.num_cached, (counts[CACHED], self.num_cached)
        assert self.num_free + self.num_private + self.num_cached == self.usable_pages
