"""The page pool: every transition checks its source state and fails without side effects."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cache import InvalidPageState, OutOfPages, PagePool
from cache.page_pool import CACHED, FREE, PRIVATE, RESERVED


def test_page_zero_is_reserved_and_never_handed_out() -> None:
    pool = PagePool(8, 1)
    pages = pool.allocate(7)
    assert sorted(pages) == list(range(1, 8))
    assert pool.state(0) == RESERVED
    with pytest.raises(OutOfPages) as err:
        pool.allocate(1, evictable=3)
    assert (err.value.requested, err.value.free, err.value.evictable) == (1, 0, 3)
    pool.check()


def test_lifecycle_free_private_cached_free() -> None:
    pool = PagePool(8, 16)
    pages = pool.allocate(3)
    assert all(pool.state(p) == PRIVATE for p in pages)
    pool.claim(pages[:2])
    assert pool.num_cached == 2 and pool.num_private == 1
    pool.uncache(pages[:2])
    pool.free_private(pages[2:])
    assert all(pool.state(p) == FREE for p in pages)
    assert pool.num_free == 7
    pool.check()


@pytest.mark.parametrize(
    ("move", "words"),
    [
        (lambda pool, p: pool.free_private([p[0], p[0]]), "listed twice"),
        (lambda pool, p: pool.free_private([p[0], p[3]]), "is cached, expected private"),
        (lambda pool, p: pool.claim([p[1], 99]), "not a page of this pool"),
        (lambda pool, p: pool.claim([p[1], 0]), "reserved"),
        (lambda pool, p: pool.uncache([p[3], p[1]]), "is private, expected cached"),
        (lambda pool, p: pool.free_private([p[4]]), "is free"),
    ],
)
def test_a_bad_transition_raises_and_changes_nothing(
    move: Callable[[PagePool, list[int]], None], words: str
) -> None:
    pool = PagePool(8, 1)
    pages = pool.allocate(4)
    pool.claim(pages[3:])
    pages.append(pool.allocate(1)[0])
    pool.free_private(pages[4:])
    before = [pool.state(p) for p in range(8)], pool.num_free, pool.num_private, pool.num_cached
    with pytest.raises(InvalidPageState, match=words):
        move(pool, pages)
    assert (
        [pool.state(p) for p in range(8)],
        pool.num_free,
        pool.num_private,
        pool.num_cached,
    ) == before
    pool.check()


def test_freed_pages_are_reused_most_recent_first() -> None:
    pool = PagePool(16, 1)
    a = pool.allocate(4)
    pool.free_private(a)
    assert pool.allocate(4) == a


@pytest.mark.parametrize(("num_pages", "page_size"), [(1, 1), (8, 3), (8, 0)])
def test_bad_pool_configuration_is_refused(num_pages: int, page_size: int) -> None:
    with pytest.raises(ValueError):
        PagePool(num_pages, page_size)


def test_check_finds_a_corrupted_pool() -> None:
    pool = PagePool(8, 1)
    pool.allocate(1)
    pool._free[pool._num_free] = pool._free[0]  # a page on the free stack twice
    pool._num_free += 1
    with pytest.raises(AssertionError, match="free list"):
        pool.check()
    assert CACHED != PRIVATE
