"""The sequence-ownership protocol: start, commit, grow, fork, finish, abort."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cache import (
    DEFAULT_NAMESPACE,
    CacheConfig,
    CacheNamespace,
    ImageToken,
    OutOfPages,
    OutOfSlots,
    PageCopy,
    SequenceCache,
    SequenceError,
    to_cache_keys,
)
from cache.integrity import check_sequence_cache
from cache.page_pool import PRIVATE


def make(num_pages: int = 64, page_size: int = 1, max_sequences: int = 8) -> SequenceCache:
    return SequenceCache(CacheConfig(num_pages, page_size, max_sequences, max(4, page_size)))


def test_a_miss_maps_private_pages_for_the_prompt_and_the_reserve() -> None:
    cache = make(page_size=4)
    seq = cache.start(list(range(10)), reserve=13)
    assert (seq.reused, seq.computed, seq.cached_pages, seq.lock_node) == (0, 0, 0, None)
    row = cache.table.row(seq.slot)
    assert len(row) == 4 and all(cache.pool.state(p) == PRIVATE for p in row)
    check_sequence_cache(cache)


def test_concurrent_duplicate_prefills_do_not_leak() -> None:
    cache = make()
    prompt = list(range(10))
    a, b = cache.start(prompt), cache.start(prompt)  # both miss: b started before a committed
    b_private = list(cache.table.row(b.slot))
    cache.commit(a, 10)
    cache.commit(b, 10)
    assert list(cache.table.row(b.slot)) == list(cache.table.row(a.slot))
    assert all(cache.pool.state(p) == 1 for p in b_private)  # b's duplicates went back to the pool
    assert cache.stats.duplicate_pages_freed == 10
    assert b.lock_node is a.lock_node and a.lock_node is not None and a.lock_node.lock_ref == 2
    check_sequence_cache(cache)
    cache.finish(a)
    cache.finish(b)
    assert cache.pool.num_free + cache.tree.cached_pages == cache.pool.usable_pages
    check_sequence_cache(cache)


def test_a_longer_duplicate_keeps_its_own_tail() -> None:
    cache = make()
    short, long = cache.start(list(range(10))), cache.start(list(range(15)))
    long_row = list(cache.table.row(long.slot))
    cache.commit(short, 10)
    claimed = cache.commit(long, 15)
    assert claimed == 5
    assert list(cache.table.row(long.slot))[10:] == long_row[10:]
    assert cache.tree.cached_pages == 15
    check_sequence_cache(cache)


def test_full_hit_with_big_pages_copies_the_shared_last_page() -> None:
    cache = make(page_size=16)
    prompt = list(range(32))
    first = cache.start(prompt)
    cache.commit(first, 32)
    cached_pages = list(cache.table.row(first.slot))
    cache.finish(first)
    again = cache.start(prompt)
    assert again.reused == 31 and again.cached_pages == 1
    row = list(cache.table.row(again.slot))
    assert row[0] == cached_pages[0] and row[1] != cached_pages[1]
    assert again.page_copies == [PageCopy(cached_pages[1], row[1], 15)]
    with pytest.raises(SequenceError, match="page copies"):
        cache.commit(again, 32)
    assert cache.take_page_copies(again) == [PageCopy(cached_pages[1], row[1], 15)]
    cache.commit(again, 32)
    assert list(cache.table.row(again.slot)) == cached_pages  # the private copy was a duplicate
    check_sequence_cache(cache)


def test_fork_shares_cached_pages_and_copies_the_partial_page() -> None:
    cache = make(page_size=4)
    parent = cache.start(list(range(10)), reserve=16)
    cache.commit(parent, 10)
    clone = cache.fork(parent)
    p_row, c_row = list(cache.table.row(parent.slot)), list(cache.table.row(clone.slot))
    assert c_row[:2] == p_row[:2] and set(c_row[2:]).isdisjoint(p_row[2:])
    assert len(c_row) == len(p_row) == 4
    assert clone.page_copies == [PageCopy(p_row[2], c_row[2], 2)]
    assert clone.lock_node is parent.lock_node and parent.lock_node is not None
    assert parent.lock_node.lock_ref == 2
    cache.take_page_copies(clone)
    check_sequence_cache(cache)
    for i, seq in enumerate((parent, clone)):
        cache.append(seq, [900 + i])
        cache.commit(seq, 11)
    cache.finish(parent)
    cache.abort(clone)
    check_sequence_cache(cache)


def test_finish_caches_generated_tokens_for_the_next_turn() -> None:
    cache = make()
    seq = cache.start([1, 2, 3])
    cache.commit(seq, 3)
    for step, token in enumerate([7, 8, 9]):
        cache.append(seq, [token])
        cache.grow(seq, 4 + step)
    cache.finish(seq, computed=5)  # the last sampled token (9) has no KV yet
    turn_two = cache.start([1, 2, 3, 7, 8, 9, 4])
    assert turn_two.reused == 5
    check_sequence_cache(cache)


def test_preempted_sequence_resumes_from_its_own_cached_prompt() -> None:
    cache = make()
    seq = cache.start(list(range(20)))
    cache.commit(seq, 20)
    cache.finish(seq)
    resumed = cache.start(list(range(20)))
    assert resumed.reused == 19
    check_sequence_cache(cache)


@pytest.mark.parametrize("stage", ["started", "committed", "forked", "grown"])
def test_abort_at_any_point_leaks_nothing(stage: str) -> None:
    cache = make(page_size=4)
    warm = cache.start(list(range(12)))
    cache.commit(warm, 12)
    cache.finish(warm)
    seq = cache.start([*range(8), 50, 51, 52], reserve=20)
    if stage != "started":
        cache.commit(seq, 11)
    others = [cache.fork(seq)] if stage == "forked" else []
    if stage == "grown":
        cache.grow(seq, 40)
    cache.abort(seq)
    for other in others:
        cache.abort(other)
    check_sequence_cache(cache)
    assert cache.pool.num_private == 0
    assert all(node.lock_ref == 0 for node in cache.tree.nodes())


def test_start_that_cannot_get_pages_changes_nothing() -> None:
    cache = make(num_pages=12)
    holder = cache.start(list(range(6)))
    cache.commit(holder, 6)
    before = (cache.pool.num_free, cache.tree.cached_pages, cache.table.active_slots)
    with pytest.raises(OutOfPages) as err:
        cache.start([*range(6), *range(100, 110)])  # 6 cached + 10 new > 5 free
    assert (err.value.requested, err.value.free, err.value.evictable) == (10, 5, 0)
    assert (cache.pool.num_free, cache.tree.cached_pages, cache.table.active_slots) == before
    assert holder.lock_node is not None and holder.lock_node.lock_ref == 1
    check_sequence_cache(cache)


def test_start_without_a_free_slot_changes_nothing() -> None:
    cache = make(max_sequences=1)
    seq = cache.start([1, 2, 3])
    cache.commit(seq, 3)
    with pytest.raises(OutOfSlots):
        cache.start([1, 2, 3, 4])
    assert seq.lock_node is not None and seq.lock_node.lock_ref == 1
    check_sequence_cache(cache)


def test_namespaces_never_share_pages() -> None:
    cache = make()
    a = cache.start([1, 2, 3, 4], CacheNamespace(tenant="a"))
    cache.commit(a, 4)
    b = cache.start([1, 2, 3, 4], CacheNamespace(tenant="b"))
    assert b.reused == 0
    assert set(cache.table.row(a.slot)).isdisjoint(cache.table.row(b.slot))
    check_sequence_cache(cache)


def test_misuse_is_refused_with_sequence_errors() -> None:
    cache = make()
    with pytest.raises(SequenceError, match="empty prompt"):
        cache.start([])
    seq = cache.start([1, 2, 3])
    cache.commit(seq, 2)
    with pytest.raises(SequenceError, match="computed=1"):
        cache.commit(seq, 1)
    with pytest.raises(SequenceError, match="computed=4"):
        cache.commit(seq, 4)
    cache.finish(seq)
    for call in (cache.finish, cache.abort, lambda s: cache.commit(s, 3), cache.fork):
        with pytest.raises(SequenceError, match="already released"):
            call(seq)
    check_sequence_cache(cache)


def test_a_hit_starts_with_the_cached_prefix_hashes() -> None:
    cache = make()
    first = cache.start(list(range(20)))
    cache.commit(first, 20)
    second = cache.start([*range(12), 77, 78])
    assert second.block_hashes == first.block_hashes[:3]
    assert second.block_hashes == cache.hasher.hashes(list(range(12)), second.namespace)


def _published_blocks(cache: SequenceCache) -> set[int]:
    return cache.tree.block_set()


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_chain_given_by_the_router_is_used_and_stores_the_same_blocks(page_size: int) -> None:
    """The router hashes the prompt to route it; the cache takes that chain instead of hashing
    the prompt again, and ends with exactly the blocks it would have computed itself."""
    prompt, ns = list(range(100, 150)), CacheNamespace(tenant="acme")
    own = make(page_size=page_size)
    chain = own.hasher.hashes(prompt, ns)
    assert len(chain) == 50 // own.hasher.block_size
    given = make(page_size=page_size)
    for cache, offered in ((own, ()), (given, chain)):
        seq = cache.start(prompt, ns, block_hashes=offered)
        cache.take_page_copies(seq)
        cache.finish(seq, len(prompt))
        check_sequence_cache(cache)
    assert own.stats.given_blocks == 0 and given.stats.given_blocks == len(chain)
    assert _published_blocks(given) == _published_blocks(own) == set(chain)


@pytest.mark.parametrize(
    "spoil",
    [
        lambda chain: [chain[0] ^ 1, *chain[1:]],  # the first block differs
        lambda chain: [*chain[:-1], chain[-1] ^ 1],  # the last block differs
        lambda chain: [*chain, 7],  # longer than the prompt's blocks
    ],
)
def test_a_chain_that_does_not_check_out_is_ignored(
    spoil: Callable[[list[int]], list[int]],
) -> None:
    prompt, ns = list(range(100, 150)), CacheNamespace(adapter="a")
    cache = make()
    chain = cache.hasher.hashes(prompt, ns)
    seq = cache.start(prompt, ns, block_hashes=spoil(chain))
    cache.finish(seq, len(prompt))
    assert cache.stats.given_blocks == 0
    assert _published_blocks(cache) == set(chain)
    other = cache.hasher.hashes(prompt, CacheNamespace(adapter="b"))  # another namespace's
    seq = cache.start(prompt, CacheNamespace(adapter="b2"), block_hashes=other)
    cache.abort(seq)
    assert cache.stats.given_blocks == 0


def test_a_prompt_with_an_image_hashes_itself() -> None:
    """The router hashes token ids only: an image's keys are the worker's, so its chain is
    never taken, even where the ends agree."""
    cache = make(num_pages=256)
    text = list(range(100, 140))
    tokens = [*text[:8], ImageToken(5, 8), *text[8:]]
    routed = cache.hasher.hashes([*text[:8], *range(8), *text[8:]], DEFAULT_NAMESPACE)
    seq = cache.start(tokens, block_hashes=routed)
    cache.finish(seq, len(seq.keys))
    assert cache.stats.given_blocks == 0
    assert _published_blocks(cache) == set(cache.hasher.hashes(seq.keys, DEFAULT_NAMESPACE))


def test_text_keys_skip_only_the_scan_for_typed_keys() -> None:
    """The worker tells `start_keys` a prompt is text (its keys came from ids, which
    `to_cache_keys` checked): the router's chain is then taken without a pass over every key,
    and the end blocks are still hashed, so a chain that does not check out is still refused."""
    prompt = list(range(100, 150))
    cache = make(num_pages=256)
    chain = cache.hasher.hashes(prompt, DEFAULT_NAMESPACE)
    spoiled = [*chain[:-1], chain[-1] ^ 1]
    seq = cache.start_keys(to_cache_keys(prompt), block_hashes=spoiled, text=True)
    assert cache.stats.given_blocks == 0
    cache.abort(seq)
    # The flag is the caller's word, passed down to `accepts`: keys with an image's typed keys,
    # offered their own chain (which checks out at both ends), are refused after the scan and
    # taken without it.
    keys = to_cache_keys([*prompt[:8], ImageToken(5, 8), *prompt[8:]])
    own = cache.hasher.hashes(keys, DEFAULT_NAMESPACE)
    for text, taken in ((False, 0), (True, len(own))):
        seq = cache.start_keys(keys, block_hashes=own, text=text)
        assert cache.stats.given_blocks == taken
        cache.abort(seq)
    check_sequence_cache(cache)


def test_start_keys_takes_keys_made_earlier_and_keeps_its_own_copy() -> None:
    """The worker makes a prompt's keys once, when the request is submitted, and starts every
    admission of its samples from them: a sequence must extend a copy, never the caller's."""
    cache = make(num_pages=256, page_size=4)
    tokens = [*range(100, 108), ImageToken(5, 8), *range(108, 120)]
    keys = to_cache_keys(tokens)
    first = cache.start_keys(keys)
    assert first.keys == keys and first.keys is not keys
    cache.commit(first, len(keys))
    cache.append(first, [7])
    assert len(keys) == 28 and len(first.keys) == 29
    cache.finish(first)
    again = cache.start_keys(keys)  # typed keys (the image's) are taken as they are
    by_tokens = cache.start(tokens)
    assert again.reused == by_tokens.reused == 27
    assert cache.table.row(again.slot)[:6] == cache.table.row(by_tokens.slot)[:6]
    cache.abort(again)
    cache.abort(by_tokens)
    with pytest.raises(TypeError, match="give tokens to start"):
        cache.start_keys([1, 2, 3])  # type: ignore[arg-type]
    check_sequence_cache(cache)


def test_trim_frees_only_private_pages_past_a_length() -> None:
    """What a rejected speculative draft's pages go back by: never a cached page, nor one
    holding a computed position."""
    cache = make(page_size=4)
    seq = cache.start(list(range(10)))  # 3 pages
    cache.commit(seq, 8)  # 2 of them cached
    cache.grow(seq, 30)  # 8 pages
    free = cache.pool.num_free
    assert cache.trim(seq, 13) == 4 and len(cache.table.row(seq.slot)) == 4
    assert cache.trim(seq, 1) == 2  # down to the computed positions' pages, the cached ones
    assert cache.trim(seq, 0) == 0 and len(cache.table.row(seq.slot)) == seq.cached_pages == 2
    assert cache.pool.num_free == free + 6
    check_sequence_cache(cache)
    cache.finish(seq)
    assert cache.pool.num_private == 0
    check_sequence_cache(cache)
