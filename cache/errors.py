"""Typed errors of the cache package; each carries the numbers that explain it.

Every error is raised before the structure it concerns is changed, so a caller that catches one
finds the pool, the tree and the page table exactly as they were.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base class of every error the cache package raises on purpose."""


class OutOfPages(CacheError):
    """An allocation asked for more pages than are free plus evictable."""

    def __init__(self, requested: int, free: int, evictable: int) -> None:
        self.requested = requested
        self.free = free
        self.evictable = evictable
        super().__init__(
            f"cannot allocate {requested} pages: {free} free, {evictable} evictable "
            f"(every other cached page is locked by a running sequence)"
        )


class OutOfSlots(CacheError):
    """Every sequence slot of the page table is in use."""

    def __init__(self, max_slots: int) -> None:
        self.max_slots = max_slots
        super().__init__(f"all {max_slots} sequence slots are in use")


class LockUnderflow(CacheError):
    """`unlock` was called on a node that holds no lock."""


class UnknownTokenType(CacheError, TypeError):
    """A token is neither an int id nor one of the cache's token types."""


class InvalidToken(CacheError, ValueError):
    """A token of a known type carries an impossible value (negative id, empty image, ...)."""


class LengthMismatch(CacheError, ValueError):
    """Pages and positions disagree: a page holds exactly `page_size` positions."""


class PageMappingError(CacheError, ValueError):
    """A page-table mapping was out of order, overlapping or outside a slot."""


class InvalidPageState(CacheError):
    """A page was moved from a state it is not in (double free, claiming a free page, ...)."""


class SequenceError(CacheError, ValueError):
    """A sequence operation that does not fit the sequence's state (released, empty, ...)."""


class IdentityMismatch(CacheError):
    """Two parties compute block hashes under different identity schemes."""
