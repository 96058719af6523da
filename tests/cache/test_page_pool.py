"""The page pool: every transition checks its source state and fails without side effects."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cache.page_pool
from cache import InvalidPageState, OutOfPages, PagePool
from cache.page_pool import CACHED, FREE, PRIVATE, RESERVED


@pytest.fixture(params=["python", "numpy"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run a test with every move on the per-page Python path, then on the numpy batch path."""
    monkeypatch.setattr(cache.page_pool, "SMALL_MOVE", 10**9 if request.param == "python" else 1)
    yield request.param


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
        # one page alone (a move's commonest size: its own fast path)
        (lambda pool, p: pool.claim([0]), "reserved"),
        (lambda pool, p: pool.claim([-1]), "not a page of this pool"),
        (lambda pool, p: pool.claim([8]), "not a page of this pool"),
        (lambda pool, p: pool.claim([2.0]), "not a page of this pool"),
        (lambda pool, p: pool.uncache([p[1]]), "is private, expected cached"),
        (lambda pool, p: pool.claim([p[3]]), "is cached, expected private"),
    ],
)
def test_a_bad_transition_raises_and_changes_nothing(
    move: Callable[[PagePool, list[int]], None], words: str, path: str
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


def test_freed_pages_are_reused_most_recent_first(path: str) -> None:
    pool = PagePool(16, 1)
    a = pool.allocate(4)
    pool.free_private(a)
    assert pool.allocate(4) == a
    assert list(pool.allocate(3)) == [5, 6, 7]
    pool.free_private(a[:2])
    pool.free_private((a[3], a[2]))
    assert list(pool.allocate(4)) == [a[3], a[2], a[0], a[1]]
    pool.check()


def test_a_large_batch_names_the_bad_page_and_changes_nothing(path: str) -> None:
    """A move of many pages is checked by numpy at once; the error names the first bad page."""
    pool = PagePool(1000, 1)
    pages = pool.allocate(300)
    assert list(pages) == list(range(1, 301))
    pool.claim(pages[100:200])
    cases = [
        ([*pages[:50], pages[150], *pages[50:99]], "page 151 is cached, expected private"),
        ([*pages[:60], pages[7]], "page 8 is listed twice"),
        ([*pages[:60], 1000], "page 1000 is not a page of this pool"),
        ([*pages[:60], -5], "page -5 is not a page of this pool"),
        ([*pages[:60], 2.0], "page 2.0 is not a page of this pool"),
        ([*pages[:60], "3"], "page '3' is not a page of this pool"),
        ([*pages[:60], 2**40], f"page {2**40} is not a page of this pool"),
        ([0, *pages[:60]], "page 0 is reserved"),
        ([*pages[:60], 400], "page 400 is free"),
    ]
    before = [pool.state(p) for p in range(1000)], pool.num_free, pool.num_private
    for bad, words in cases:
        with pytest.raises(InvalidPageState, match=words):
            pool.free_private(bad)
        with pytest.raises(InvalidPageState, match=words.split(" is ")[0]):
            pool.claim(tuple(bad))
        assert ([pool.state(p) for p in range(1000)], pool.num_free, pool.num_private) == before
    with pytest.raises(InvalidPageState, match="page 251 is private, expected cached"):
        pool.uncache([*pages[100:199], pages[250]])
    pool.require(pages[100:200] * 2, CACHED)  # a read-only check: repeats are fine
    pool.uncache(iter(pages[100:200]))
    pool.free_private(pages[:100] + pages[200:])
    assert pool.num_free == 999 and pool.num_private == pool.num_cached == 0
    pool.check()


def test_a_refused_array_of_pages_stays_the_callers_to_change(path: str) -> None:
    """numpy reads an `array("i")` of pages in place; a refused move must not keep that view
    alive in its error (the array could then never grow again)."""
    pool = PagePool(100, 1)
    pages = pool.allocate(40)
    pages[5] = 0
    with pytest.raises(InvalidPageState, match="page 0 is reserved") as refused:
        pool.free_private(pages)
    pages.append(1)  # BufferError while the error pinned a view of the array's memory
    del pages[-1]
    pages[5] = 6
    pool.free_private(pages)
    assert refused.value is not None and pool.num_free == 99
    with pytest.raises(InvalidPageState, match="page -1 is not a page of this pool"):
        pool.state(-1)


def test_allocate_refuses_a_page_on_the_free_stack_that_is_not_free(path: str) -> None:
    pool = PagePool(64, 1)
    pool._state[3] = CACHED  # corrupt: page 3 is still on the free stack
    with pytest.raises(InvalidPageState, match="page 3 is cached, expected free"):
        pool.allocate(40)
    assert pool.num_free == 63 and pool.num_private == 0


def test_bookkeeping_is_seven_bytes_a_page() -> None:
    """SGLang's free list at page size 1 is an int64 tensor, 8 bytes a page. Ours holds 7: a state
    byte, an int32 stack entry and a uint16 stamp for the repeated-page check. A move's
    temporaries last only for the call."""
    num_pages = 200_000
    tracemalloc.start()
    try:
        pool = PagePool(num_pages, 1)
        held, peak = tracemalloc.get_traced_memory()
        pages = pool.allocate(num_pages - 1)  # the caller's list of Python ints, not the pool's
        node_pages = tuple(pages)  # as a tree node holds them
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        pool.claim(pages)
        pool.uncache(node_pages)
        after, move_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert pool.nbytes == 7 * num_pages - 4  # page 0 is never on the free stack
    assert pool._free.dtype == np.intc and pool._free.nbytes == 4 * (num_pages - 1)
    assert held <= 7 * num_pages + 4096 and peak <= 8 * num_pages, (held, peak)
    assert after - before <= 4096, "a move left memory behind"
    # Per page moved (this move is past the stamps: it sorts): the batch (int32), the indices
    # numpy's take widens to intp and their sorted copy, a few bytes of flags. Transient, and
    # proportional to the move, not to the pool.
    assert move_peak - before <= 24 * num_pages, move_peak - before
    pool.check()


@given(
    st.integers(2, 3000),
    st.integers(0, 2999),
    st.integers(0, 2999),
    st.sampled_from(["free_private", "claim"]),
)
@settings(max_examples=60, deadline=None)
def test_a_page_listed_twice_anywhere_is_refused(
    count: int, first: int, second: int, move: str
) -> None:
    """The stamps find a repeat wherever the two listings sit, and a refused move changes
    nothing; the same batch without the repeat moves."""
    pool = PagePool(4000, 1)
    pages = pool.allocate(count)
    first, second = sorted((first % count, second % count))
    batch = [*pages[:second], pages[first], *pages[second:]]
    before = bytes(pool._state), pool.num_free, pool.num_private
    with pytest.raises(InvalidPageState, match=f"page {pages[first]} is listed twice"):
        getattr(pool, move)(batch)
    assert (bytes(pool._state), pool.num_free, pool.num_private) == before
    getattr(pool, move)(pages)
    pool.check()


@pytest.mark.parametrize("count", [65_535, 65_536, 65_537, 70_001])
def test_moves_around_the_stamps_limit_find_a_repeat_at_either_end(count: int) -> None:
    """Up to 65,536 pages the stamps check repeats; past that the batch is sorted."""
    pool = PagePool(count + 1, 1)
    pages = pool.allocate(count)
    for bad in ([*pages, pages[0]], [pages[-1], *pages]):
        with pytest.raises(InvalidPageState, match="listed twice"):
            pool.claim(bad)
        assert pool.num_private == count and pool.num_cached == 0
    pool.claim(pages)
    pool.uncache(pages)
    assert pool.num_free == count
    pool.check()


def test_require_takes_only_states_a_page_can_be_in() -> None:
    pool = PagePool(64, 1)
    with pytest.raises(ValueError, match="free, private or cached"):
        pool.require(list(range(40)), RESERVED)


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


def test_one_page_given_as_a_numpy_integer_moves(path: str) -> None:
    """A page id that is a numpy integer, not an int, takes the general checks and moves."""
    pool = PagePool(8, 1)
    (page,) = pool.allocate(1)
    pool.claim([np.int32(page)])
    assert pool.state(page) == CACHED
    pool.uncache(np.array([page], dtype=np.int64))
    assert pool.state(page) == FREE and pool.num_free == 7
    pool.check()
