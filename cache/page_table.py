"""The page table: which physical pages each sequence slot maps, in logical order.

Seed 000's PageTable methods, over integers (the worker mirrors the rows into an int32 tensor):

    slot row:  [ cached | cached | cached | private | private ]   logical page 0, 1, 2, ...
                \\---- shared, owned by the tree ---/ \\-- this sequence's own --/

A row's leading pages may belong to the cache (mapped by any number of slots); the rest are
private to the slot. `erase(slot, cached_page_count)` frees only the private tail. Allocation
evicts from the cache on demand through the `Evictor` it was given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from cache.errors import OutOfPages, OutOfSlots, PageMappingError
from cache.page_pool import CACHED, PRIVATE, PageIds, PagePool


class Evictor(Protocol):
    """What the page table needs of a cache: free pages on demand, and how many it could."""

    @property
    def evictable_pages(self) -> int: ...

    def evict(self, needed_pages: int) -> int: ...


class PageTable:
    def __init__(self, pool: PagePool, max_slots: int, evictor: Evictor | None = None) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.pool = pool
        self.page_size = pool.page_size
        self.max_slots = max_slots
        self.evictor = evictor
        self._rows: list[list[int] | None] = [None] * max_slots
        self._free_slots = list(range(max_slots - 1, -1, -1))

    def set_evictor(self, evictor: Evictor) -> None:
        self.evictor = evictor

    # -- slots ---------------------------------------------------------------------------------
    def allocate(self) -> int:
        """Take a free slot (a row of the page table)."""
        if not self._free_slots:
            raise OutOfSlots(self.max_slots)
        slot = self._free_slots.pop()
        self._rows[slot] = []
        return slot

    def _row(self, slot: int) -> list[int]:
        row = self._rows[slot] if 0 <= slot < self.max_slots else None
        if row is None:
            raise PageMappingError(f"slot {slot} is not allocated")
        return row

    def row(self, slot: int) -> Sequence[int]:
        """The physical pages of `slot` in logical order (read-only view)."""
        return self._row(slot)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def active_slots(self) -> list[int]:
        return [s for s, row in enumerate(self._rows) if row is not None]

    # -- pages ---------------------------------------------------------------------------------
    @property
    def evictable_pages(self) -> int:
        return self.evictor.evictable_pages if self.evictor is not None else 0

    def can_reserve_with_eviction(self, num_pages: int) -> bool:
        """Whether `allocate_pages(num_pages)` would succeed, evicting if it must."""
        return num_pages <= self.pool.num_free + self.evictable_pages

    def allocate_pages(self, count: int) -> PageIds:
        """Take `count` private pages, evicting unlocked cached pages when the pool runs short.

        Raises `OutOfPages` (and evicts nothing) when even eviction cannot supply them.
        """
        free = self.pool.num_free
        if count > free:
            evictable = self.evictable_pages
            if count > free + evictable:
                raise OutOfPages(count, free, evictable)
            assert self.evictor is not None
            self.evictor.evict(count - free)
        return self.pool.allocate(count, self.evictable_pages)

    def map_pages(
        self, slot: int, logical_start: int, pages: Sequence[int], *, validate: bool = True
    ) -> None:
        """Append `pages` to the slot's row; `logical_start` must be the row's current length.

        `validate` checks that every page is allocated (private or cached); callers that got the
        pages from `allocate_pages` or from a locked match skip it (it is O(pages)).
        """
        row = self._row(slot)
        if logical_start != len(row):
            raise PageMappingError(
                f"map_pages must be sequential: slot {slot} maps {len(row)} pages, "
                f"got logical_start={logical_start}"
            )
        if validate:
            for page in pages:
                state = self.pool.state(page) if 0 < page < self.pool.num_pages else -1
                if state not in (PRIVATE, CACHED):
                    raise PageMappingError(f"page {page} is not allocated; it cannot be mapped")
        row.extend(pages)

    def replace_pages(self, slot: int, logical_start: int, pages: Sequence[int]) -> list[int]:
        """Overwrite row entries from `logical_start`; returns the pages that were there."""
        row = self._row(slot)
        end = logical_start + len(pages)
        if not 0 <= logical_start <= end <= len(row):
            raise PageMappingError(
                f"cannot replace pages [{logical_start}, {end}) of slot {slot} "
                f"which maps {len(row)}"
            )
        old = row[logical_start:end]
        row[logical_start:end] = pages
        return old

    def get_pages(self, slot: int, start: int, end: int) -> list[int]:
        row = self._row(slot)
        if not 0 <= start <= end <= len(row):
            raise PageMappingError(f"pages [{start}, {end}) outside slot {slot} of {len(row)}")
        return row[start:end]

    def free_pages_to_pool(self, pages: Sequence[int]) -> None:
        """Return private pages that were never mapped (or were unmapped) to the pool."""
        self.pool.free_private(pages)

    def truncate(self, slot: int, keep: int) -> int:
        """Return the slot's pages after its first `keep` (private pages) to the pool; returns
        how many."""
        row = self._row(slot)
        if keep < 0:
            raise PageMappingError(f"cannot keep {keep} pages of slot {slot}")
        if keep >= len(row):
            return 0
        freed = len(row) - keep
        self.pool.free_private(row[keep:])  # checks that each is private, or changes nothing
        del row[keep:]
        return freed

    def erase(self, slot: int, cached_page_count: int = 0) -> None:
        """Release the slot; its pages after the first `cached_page_count` return to the pool."""
        row = self._row(slot)
        if not 0 <= cached_page_count <= len(row):
            raise PageMappingError(
                f"cached_page_count {cached_page_count} outside slot {slot} of {len(row)} pages"
            )
        self.pool.free_private(row[cached_page_count:])
        self._rows[slot] = None
        self._free_slots.append(slot)
