"""Every bad input to the cache raises a typed error and leaves every structure as it was."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cache import (
    CacheConfig,
    CacheError,
    LengthMismatch,
    LockUnderflow,
    OutOfPages,
    PageMappingError,
    SequenceCache,
    SequenceError,
    UnknownTokenType,
)
from cache.integrity import check_sequence_cache


def populated() -> SequenceCache:
    """A cache whose every page is cached or private, with two running sequences."""
    cache = SequenceCache(CacheConfig(num_pages=41, page_size=1, max_sequences=4, block_size=4))
    for prompt in (list(range(10)), list(range(500, 505))):
        done = cache.start(prompt)
        cache.commit(done, len(prompt))
        cache.finish(done)
    one = cache.start([*range(10), 50, 51, 52, 53, 54])
    cache.commit(one, 15)
    cache.start(list(range(300, 315)))
    return cache


def state(cache: SequenceCache) -> tuple[object, ...]:
    nodes = sorted((n.start, n.keys, n.pages, n.lock_ref) for n in cache.tree.nodes())
    rows = [(s.slot, list(cache.table.row(s.slot)), s.cached_pages, s.computed) for s in cache.live]
    pages = [cache.pool.state(p) for p in range(cache.pool.num_pages)]
    return (nodes, rows, pages, cache.events.seq, cache.tree.evictable_pages)


def _unlock_below_zero(cache: SequenceCache) -> None:
    cache.tree.unlock(next(n for n in cache.tree.nodes() if n.lock_ref == 0))


def _map_out_of_order(cache: SequenceCache) -> None:
    seq = cache.live[0]
    cache.table.map_pages(seq.slot, 0, [cache.table.row(seq.slot)[-1]])


def _allocate_past_capacity(cache: SequenceCache) -> None:
    cache.table.allocate_pages(cache.pool.num_free + cache.tree.evictable_pages + 1)


def _start_past_capacity(cache: SequenceCache) -> None:
    cache.start(list(range(1000, 1030)))


def _unknown_token_type(cache: SequenceCache) -> None:
    cache.start([1, 2, "three"])  # type: ignore[list-item]


def _insert_mismatched_lengths(cache: SequenceCache) -> None:
    cache.tree.insert([1, 2, 3], [cache.table.row(cache.live[0].slot)[-1]])


def _insert_pages_that_are_not_private(cache: SequenceCache) -> None:
    cached = next(iter(cache.tree.nodes())).pages
    cache.tree.insert(list(range(700, 700 + len(cached))), list(cached))


def _commit_beyond_keys(cache: SequenceCache) -> None:
    cache.commit(cache.live[0], 99)


def _append_bad_token(cache: SequenceCache) -> None:
    cache.append(cache.live[0], [None])  # type: ignore[list-item]


def _empty_prompt(cache: SequenceCache) -> None:
    cache.start([])


CASES: list[tuple[Callable[[SequenceCache], None], type[CacheError], str]] = [
    (_unlock_below_zero, LockUnderflow, "holds no lock"),
    (_map_out_of_order, PageMappingError, "sequential"),
    (_allocate_past_capacity, OutOfPages, "evictable"),
    (_start_past_capacity, OutOfPages, "cannot allocate"),
    (_unknown_token_type, UnknownTokenType, "str"),
    (_insert_mismatched_lengths, LengthMismatch, "1 pages of 1 positions cannot hold 3"),
    (_insert_pages_that_are_not_private, CacheError, "expected private"),
    (_commit_beyond_keys, SequenceError, "computed=99"),
    (_append_bad_token, UnknownTokenType, "NoneType"),
    (_empty_prompt, SequenceError, "empty prompt"),
]


@pytest.mark.parametrize(("call", "error", "words"), CASES, ids=[c[0].__name__ for c in CASES])
def test_bad_input_raises_a_typed_error_and_changes_nothing(
    call: Callable[[SequenceCache], None], error: type[CacheError], words: str
) -> None:
    cache = populated()
    before = state(cache)
    with pytest.raises(error, match=words):
        call(cache)
    assert state(cache) == before
    check_sequence_cache(cache)
    seq = cache.start([*range(10), 50, 51, 52, 53, 54, 55])  # and the cache still serves
    assert seq.reused == 15
