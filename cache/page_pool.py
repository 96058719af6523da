"""The pool of KV pages and the state of every page in it.

Every page is in exactly one state, and every transition checks the state it leaves:

    FREE --allocate--> PRIVATE --claim--> CACHED --uncache--> FREE
                          \\------------free_private-----------> FREE

PRIVATE pages belong to one sequence; CACHED pages to one radix-tree node. Page 0 is RESERVED
(the null page that padded page-table entries point at) and never changes state. The pool knows
nothing of trees or sequences; it makes double frees and leaks impossible to miss.

Bookkeeping is in typed arrays, seven bytes a page: a state byte per page (a bytearray, with a
numpy view of the same bytes), the free stack (int32) and a scratch stamp per page (uint16) for
the repeated-page check. A move of many pages is checked and applied by numpy over the whole
batch; a move of a few pages stays in plain Python, where numpy's fixed cost per call would
dominate.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from operator import itemgetter
from typing import Final, TypeAlias

import numpy as np
import numpy.typing as npt

from cache.errors import InvalidPageState, OutOfPages

RESERVED: Final = 0
FREE: Final = 1
PRIVATE: Final = 2
CACHED: Final = 3
STATE_NAMES: Final = {RESERVED: "reserved", FREE: "free", PRIVATE: "private", CACHED: "cached"}
NULL_PAGE: Final = 0
MAX_PAGES: Final = 2**31 - 1
"""Page ids are C ints (int32) on the free stack and in the batches numpy checks."""
SMALL_MOVE: Final = 32
"""Moves of fewer pages than this run in plain Python: numpy costs a few microseconds a call."""
_STAMPS = np.arange(1 << 16, dtype=np.uint16)
"""Stamps for the repeated-page check of moves of up to 65,536 pages (larger ones sort)."""

PageArray = npt.NDArray[np.intc]
PageIds: TypeAlias = "array[int]"
"""Page ids as the pool hands them out and the tree keeps them: an `array("i")`."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if not 2 <= num_pages <= MAX_PAGES:
            raise ValueError(
                f"num_pages must be in [2, {MAX_PAGES}] (page 0 is reserved), got {num_pages}"
            )
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._state = bytearray([FREE]) * num_pages
        self._state[NULL_PAGE] = RESERVED
        self._states = np.frombuffer(self._state, dtype=np.uint8)  # the same bytes, writable
        # A stack, top at _free[_num_free - 1]: the most recently freed page is reused first (it
        # is likely still in L2). Initially pages 1, 2, 3, ... come out in that order.
        self._free: PageArray = np.arange(num_pages - 1, 0, -1, dtype=np.intc)
        self._num_free = num_pages - 1
        self._stamp = np.zeros(num_pages, dtype=np.uint16)  # scratch: see _distinct
        self.num_private = 0
        self.num_cached = 0

    @property
    def usable_pages(self) -> int:
        """Pages that can ever hold KV: all but the null page."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def nbytes(self) -> int:
        """Bytes of the per-page bookkeeping (state bytes, free stack, stamps): 7 a page."""
        return len(self._state) + self._free.nbytes + self._stamp.nbytes

    def state(self, page: int) -> int:
        if not 0 <= page < self.num_pages:
            raise InvalidPageState(f"page {page!r} is not a page of this pool")
        return self._state[page]

    def allocate(self, count: int, evictable: int = 0) -> PageIds:
        """Take `count` free pages, now PRIVATE, as an `array("i")`. `evictable` only informs the
        error message."""
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({count})")
        top = self._num_free
        if count > top:
            raise OutOfPages(count, top, evictable)
        if count == 0:
            return array("i")
        taken = self._free[top - count : top][::-1]
        pages = array("i", taken.tobytes())
        # Stack entries are distinct pages in range (only checked moves push them): verifying
        # that each is FREE is the whole check.
        if count < SMALL_MOVE:
            self._move_few(pages, FREE, PRIVATE)
        else:
            states, index = self._states, taken.astype(np.intp)
            if states.take(index).tobytes().count(FREE) != count:
                raise self._bad_move(pages, FREE, PRIVATE)
            states[index] = PRIVATE
        self._num_free = top - count
        self.num_private += count
        return pages

    def _move(self, pages: Iterable[int], src: int, dst: int) -> Sequence[int] | PageArray:
        """Move every page from `src` to `dst`, or none of them (a repeated page is an error).

        Returns the pages moved, as a list or as an int32 array, in the order given.
        """
        if type(pages) is array and pages.typecode == "i":
            if len(pages) < SMALL_MOVE:
                return self._move_few(pages, src, dst)
            batch = np.frombuffer(pages, dtype=np.intc)  # the same memory: no conversion
        else:
            if not isinstance(pages, list | tuple):
                pages = list(pages)
            if len(pages) < SMALL_MOVE:
                return self._move_few(pages, src, dst)
            try:  # C ints, at C speed: a float, a str or a huge int raises here
                batch = np.frombuffer(array("i", pages), dtype=np.intc)
            except (TypeError, OverflowError):
                raise self._bad_move(pages, src, dst) from None
        if not self._move_many(batch, src, dst):
            del batch  # a view of the caller's array: the error must not pin its buffer
            raise self._bad_move(pages, src, dst)
        return batch

    def _move_few(self, pages: Sequence[int], src: int, dst: int) -> Sequence[int]:
        if not pages:
            return pages
        state = self._state
        if len(pages) == 1:  # the commonest move (a partial last page): no tuple, no set
            page = pages[0]
            if type(page) is int and 0 < page < self.num_pages and state[page] == src:
                state[page] = dst
                return pages  # anything else: the checks below, and their error
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

    def _move_many(self, batch: PageArray, src: int, dst: int) -> bool:
        """`_move` over an int32 array: False, changing nothing, if any page may not move.

        The batch is widened to intp once, read as unsigned so that a negative id lands past
        the pool's end: `take` then refuses every id out of range, and page 0 (reserved) is in
        no state a move leaves. `take` and index assignment with native indices cost about half
        what they do with int32 ones (and `put` costs three times as much).
        """
        index = batch.view(np.uint32).astype(np.intp)
        states = self._states
        try:
            if states.take(index).tobytes().count(src) != len(batch):
                return False
        except IndexError:
            return False
        if src != dst:
            if not self._distinct(index):
                return False
            states[index] = dst
        return True

    def _distinct(self, index: npt.NDArray[np.intp]) -> bool:
        """Whether no page is listed twice, in two C passes and no sort: stamp each listed
        page's scratch slot with its position in the list, then read the stamps back. A page
        listed twice keeps only its later stamp, so its earlier position reads the wrong one.
        A batch longer than the stamps go is sorted instead."""
        count = len(index)
        if count > len(_STAMPS):
            ordered = np.sort(index)
            return b"\x01" not in (ordered[1:] == ordered[:-1]).tobytes()
        stamps = _STAMPS[:count]
        self._stamp[index] = stamps
        return self._stamp.take(index).tobytes() == stamps.tobytes()

    def _bad_move(self, pages: Iterable[int], src: int, dst: int) -> InvalidPageState:
        pages = list(pages)
        seen: set[int] = set()
        for page in pages:
            if not isinstance(page, int | np.integer) or not 0 <= page < self.num_pages:
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

    def _push_free(self, moved: Sequence[int] | PageArray) -> None:
        top, count = self._num_free, len(moved)
        if count == 1:
            self._free[top] = moved[0]  # a sixth of a slice assignment's cost
        elif count:  # none: a page-aligned sequence's partial last page, every time at page 1
            self._free[top : top + count] = moved[::-1]
        self._num_free = top + count

    def free_private(self, pages: Iterable[int]) -> None:
        """Return a sequence's private pages to the pool."""
        moved = self._move(pages, PRIVATE, FREE)
        self._push_free(moved)
        self.num_private -= len(moved)

    def claim(self, pages: Iterable[int]) -> None:
        """Private pages become owned by the cache."""
        moved = self._move(pages, PRIVATE, CACHED)
        self.num_private -= len(moved)
        self.num_cached += len(moved)

    def uncache(self, pages: Iterable[int]) -> None:
        """Cache-owned pages (an evicted node's) return to the pool."""
        moved = self._move(pages, CACHED, FREE)
        self._push_free(moved)
        self.num_cached -= len(moved)

    def require(self, pages: Iterable[int], state: int) -> None:
        """Raise `InvalidPageState` unless every page is in `state` (nothing changes): free,
        private or cached (page 0's reserved state is no state a page can be required in)."""
        if state not in (FREE, PRIVATE, CACHED):
            raise ValueError(f"require takes free, private or cached, got {state!r}")
        self._move(pages, state, state)

    def check(self) -> None:
        """Assert the pool's own invariants (counts agree with states; the free list is exact)."""
        counts = np.bincount(self._states, minlength=len(STATE_NAMES)).tolist()
        assert len(counts) == len(STATE_NAMES), f"a page in an unknown state: {counts}"
        assert counts[RESERVED] == 1 and self._state[NULL_PAGE] == RESERVED, "page 0 not reserved"
        free = self._free[: self._num_free]
        distinct = len(np.unique(free))
        assert counts[FREE] == len(free) == distinct, (
            f"free list has {len(free)} entries ({distinct} distinct), "
            f"{counts[FREE]} pages are free"
        )
        on_list = self._states[free]
        assert (free > 0).all() and (on_list == FREE).all(), "a non-free page is on the list"
        assert counts[PRIVATE] == self.num_private, (counts[PRIVATE], self.num_private)
        assert counts[CACHED] == self.num_cached, (counts[CACHED], self.num_cached)
        assert self.num_free + self.num_private + self.num_cached == self.usable_pages
