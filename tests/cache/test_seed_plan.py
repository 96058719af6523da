"""Seed 000's test plan (tests 1-18), adapted to radixmesh's cache.

Adaptations: keys are per KV position (an image expands to its positions), so seed 000's
`from_page_idx` is implied by `from_node`; pages come from a real pool instead of literal ranges;
`unlock` underflow raises `LockUnderflow` instead of AssertionError. Test 12 (logit equivalence)
needs a model and lives with the worker.
"""

from __future__ import annotations

import pytest

from cache import (
    CacheConfig,
    CacheNamespace,
    ImageToken,
    LockUnderflow,
    OutOfPages,
    SequenceCache,
    TextToken,
    to_cache_keys,
)
from cache.integrity import check_sequence_cache
from tests.cache.helpers import BOS, make_stack

A, B, C, D, X = 11, 12, 13, 14, 99


# -- A) radix tree correctness ----------------------------------------------------------------
def test_1_split_correctness() -> None:
    s = make_stack()
    pages = s.table.allocate_pages(4)
    s.tree.insert([A, B, C, D], pages)
    match = s.tree.match([A, B, X])
    assert match.length == 2
    assert match.pages == pages[:2]
    parent = match.last_node
    assert parent is not None and tuple(parent.keys) == (A, B)
    (child,) = parent.children.values()
    assert tuple(child.keys) == (C, D)
    assert child.pages == pages[2:]
    s.check()


def test_2_image_kv_length_accounting() -> None:
    s = make_stack(num_pages=1000)
    image = ImageToken(content_hash=0xABCDEF, kv_length=729)
    keys = to_cache_keys([TextToken(BOS), image, TextToken(1), TextToken(2)])
    assert len(keys) == 732
    s.tree.insert(keys, s.table.allocate_pages(732))
    match = s.tree.match(keys)
    assert match.length == 732 and len(match.pages) == 732
    partial = s.tree.match(to_cache_keys([TextToken(BOS), image]))
    assert partial.length == 730
    s.check()


def test_3_lock_ref_invariants() -> None:
    s = make_stack()
    node = s.tree.insert([A, B, C], s.table.allocate_pages(3)).node
    s.tree.lock(node)
    assert node.lock_ref == 1
    assert node.parent is not None and node.parent.lock_ref == 1  # ancestors (the root) too
    s.tree.unlock(node)
    assert node.lock_ref == 0 and node.parent.lock_ref == 0
    with pytest.raises(LockUnderflow):
        s.tree.unlock(node)
    assert node.lock_ref == 0 and node.parent.lock_ref == 0  # the failed unlock changed nothing
    s.check()


# -- B) page ownership / freeing --------------------------------------------------------------
def test_4_cache_miss_full_prefill_pages_stay_cached() -> None:
    s = make_stack()
    initial_free = s.pool.num_free
    slot = s.table.allocate()
    pages = s.table.allocate_pages(10)
    s.table.map_pages(slot, 0, pages)
    result = s.tree.insert(list(range(100, 110)), pages)
    s.tree.lock(result.node)
    cache_owned = result.inserted_pages
    assert cache_owned == 10
    s.tree.unlock(result.node)
    s.table.erase(slot, cached_page_count=cache_owned)
    assert s.pool.num_free == initial_free - 10
    assert s.tree.evict(10) == 10
    assert s.pool.num_free == initial_free
    s.check()


def test_5_partial_hit_all_prompt_pages_cached() -> None:
    s = make_stack()
    tokens = list(range(200, 210))
    s.tree.insert(tokens[:5], s.table.allocate_pages(5))
    slot = s.table.allocate()
    match = s.tree.match(tokens)
    assert match.length == 5
    s.tree.lock(match.last_node)
    s.table.map_pages(slot, 0, match.pages)
    new_pages = s.table.allocate_pages(5)
    s.table.map_pages(slot, match.length, new_pages)
    result = s.tree.insert(tokens, match.pages + new_pages, from_node=match.last_node)
    assert result.inserted_pages == 5
    assert match.length + result.inserted_pages == 10
    s.tree.lock(result.node)
    s.tree.unlock(match.last_node)
    s.tree.unlock(result.node)
    free_before = s.pool.num_free
    s.table.erase(slot, cached_page_count=10)
    assert s.pool.num_free == free_before  # nothing private was left: all 10 are the cache's
    assert s.tree.cached_pages == 10
    s.check()


# -- C) insert idempotency and lock transfer --------------------------------------------------
def test_6_insert_twice_returns_existing_node_and_claims_nothing() -> None:
    s = make_stack()
    tokens, pages = [A, B, C, D], s.table.allocate_pages(4)
    first = s.tree.insert(tokens, pages)
    assert first.inserted_pages == 4
    second = s.tree.insert(tokens, pages)
    assert second.node is first.node
    assert second.inserted_pages == 0
    assert second.existing_pages == pages
    assert s.tree.total_cached_pages == 4
    s.check()


def test_7_lock_transfer_identity_case() -> None:
    s = make_stack()
    tokens = [1, 2, 3]
    result = s.tree.insert(tokens, s.table.allocate_pages(3))
    s.tree.lock(result.node)
    assert result.node.lock_ref == 1 and result.inserted_pages == 3
    s.tree.unlock(result.node)
    match = s.tree.match(tokens)
    assert match.last_node is result.node and match.length == 3
    temp_lock = match.last_node
    s.tree.lock(temp_lock)
    again = s.tree.insert(tokens, list(result.node.pages))
    assert again.node is temp_lock and again.inserted_pages == 0
    lock_node = temp_lock  # identity: keep the lock we hold rather than lock + unlock
    assert lock_node.lock_ref == 1
    s.tree.unlock(lock_node)
    assert lock_node.lock_ref == 0
    s.check()


def test_8_full_prompt_match_computes_one_position() -> None:
    cache = SequenceCache(CacheConfig(num_pages=50))
    prompt = [BOS, 1, 2]
    first = cache.start(prompt)
    cache.commit(first, 3)
    cache.finish(first)
    second = cache.start(prompt)
    assert second.reused == len(prompt) - 1
    row = list(cache.table.row(second.slot))
    assert cache.pool.state(row[-1]) == 2  # the last position goes into a private page
    check_sequence_cache(cache)


def test_9_sequences_share_cached_pages_and_decode_apart() -> None:
    cache = SequenceCache(CacheConfig(num_pages=200))
    image = ImageToken(0x1234, 16)
    prompt = [TextToken(BOS), image, TextToken(1)]
    one = cache.start(prompt)
    cache.commit(one, 18)
    two = cache.start(prompt)  # `one` is still running
    cache.commit(two, 18)
    assert cache.table.get_pages(one.slot, 0, 17) == cache.table.get_pages(two.slot, 0, 17)
    for step in range(10):
        for seq in (one, two):
            cache.append(seq, [500 + step])
            cache.grow(seq, 18 + step + 1)
    decode_one = cache.table.get_pages(one.slot, 18, 28)
    decode_two = cache.table.get_pages(two.slot, 18, 28)
    assert set(decode_one).isdisjoint(decode_two)
    check_sequence_cache(cache)


def test_10_full_prompt_match_page_ownership() -> None:
    s = make_stack()
    tokens, prompt_len = [BOS, 1, 2, 3], 4
    slot_1 = s.table.allocate()
    pages = s.table.allocate_pages(prompt_len)
    s.table.map_pages(slot_1, 0, pages)
    inserted = s.tree.insert(tokens, pages)
    s.tree.lock(inserted.node)
    s.tree.unlock(inserted.node)
    s.table.erase(slot_1, cached_page_count=inserted.inserted_pages)
    initial_free = s.pool.num_free
    slot_2 = s.table.allocate()
    match = s.tree.match(tokens)
    assert match.length == prompt_len
    skip = min(match.length, prompt_len - 1)
    s.table.map_pages(slot_2, 0, match.pages[:skip])
    assert len(s.table.row(slot_2)) == skip
    private = s.table.allocate_pages(1)
    s.table.map_pages(slot_2, skip, private)
    s.tree.lock(match.last_node)
    last_page = s.table.get_pages(slot_2, prompt_len - 1, prompt_len)[0]
    assert last_page in private and last_page not in match.pages
    s.tree.unlock(match.last_node)
    s.table.erase(slot_2, cached_page_count=skip)
    assert s.pool.state(private[0]) == 1  # free
    assert s.pool.num_free == initial_free
    s.check()


def test_11_tiny_hit_does_not_leak() -> None:
    s = make_stack()

    def conserved() -> None:
        assert s.pool.num_free + s.tree.total_cached_pages == s.usable

    prompt_1 = [BOS, *range(1, 10)]
    slot_1 = s.table.allocate()
    pages_1 = s.table.allocate_pages(10)
    s.table.map_pages(slot_1, 0, pages_1)
    result_1 = s.tree.insert(prompt_1, pages_1)
    s.tree.lock(result_1.node)
    assert result_1.inserted_pages == 10
    s.tree.unlock(result_1.node)
    s.table.erase(slot_1, cached_page_count=10)
    conserved()
    prompt_2 = [BOS, 100, 101]
    slot_2 = s.table.allocate()
    match = s.tree.match(prompt_2)
    assert match.length == 1
    s.table.map_pages(slot_2, 0, match.pages)
    suffix = s.table.allocate_pages(2)
    s.table.map_pages(slot_2, 1, suffix)
    s.tree.lock(match.last_node)
    result_2 = s.tree.insert(prompt_2, match.pages + suffix, from_node=match.last_node)
    assert result_2.inserted_pages == 2
    assert result_2.node is not match.last_node
    s.tree.lock(result_2.node)
    s.tree.unlock(match.last_node)
    s.tree.unlock(result_2.node)
    s.table.erase(slot_2, cached_page_count=1 + result_2.inserted_pages)
    conserved()
    s.tree.evict(s.usable)
    assert s.pool.num_free == s.usable
    s.check()


# -- E) stress --------------------------------------------------------------------------------
def test_13_memory_pressure_with_locked_pages() -> None:
    s = make_stack(num_pages=101)
    locked = []
    for i in range(20):
        node = s.tree.insert([1000 + i, *range(4)], s.table.allocate_pages(5)).node
        s.tree.lock(node)
        locked.append(node)
    assert s.pool.num_free == 0 and s.tree.evictable_pages == 0
    with pytest.raises(OutOfPages) as err:
        s.table.allocate_pages(10)
    assert (err.value.requested, err.value.free, err.value.evictable) == (10, 0, 0)
    assert "10 pages" in str(err.value)
    s.check()
    for node in locked[:10]:
        s.tree.unlock(node)
    assert s.tree.evictable_pages == 50
    assert len(s.table.allocate_pages(10)) == 10
    s.check()


def test_14_and_15_no_double_free_and_page_conservation() -> None:
    cache = SequenceCache(CacheConfig(num_pages=100))
    for i in range(50):
        seq = cache.start([BOS, *range(i % 10 + 1)])
        cache.commit(seq, len(seq.keys))
        cache.finish(seq)
        check_sequence_cache(cache)
    full = cache.start([BOS, 0, 1])
    assert full.reused == 2
    cache.finish(full)
    partial = cache.start([BOS, 0, 3, 4])
    assert partial.reused == 2
    cache.commit(partial, 4)
    cache.finish(partial)
    check_sequence_cache(cache)
    assert cache.pool.num_free + cache.tree.cached_pages == cache.pool.usable_pages
    cache.tree.evict(cache.pool.usable_pages)
    assert cache.pool.num_free == cache.pool.usable_pages


def test_16_namespace_pruning() -> None:
    s = make_stack()
    namespaces = [CacheNamespace(image_hash=i) for i in range(10)]
    for ns in namespaces:
        s.tree.insert([BOS, 1, 2], s.table.allocate_pages(3), namespace=ns)
    assert len(s.tree.roots) == 10
    s.tree.evict(100)
    assert len(s.tree.roots) == 0
    s.tree.insert([BOS, 1], s.table.allocate_pages(2), namespace=namespaces[0])
    assert len(s.tree.roots) == 1
    s.check()


def test_17_match_only_creates_no_roots() -> None:
    s = make_stack()
    for i in range(100):
        result = s.tree.match([BOS, 1, 2], namespace=CacheNamespace(image_hash=i))
        assert result.length == 0 and result.last_node is None
    assert len(s.tree.roots) == 0
    ns = CacheNamespace(image_hash=42)
    s.tree.insert([BOS, 1, 2], s.table.allocate_pages(3), namespace=ns)
    assert len(s.tree.roots) == 1
    assert s.tree.match([BOS, 1, 2], namespace=ns).length == 3


def test_18_from_node_aligns_pages_with_variable_length_tokens() -> None:
    s = make_stack(num_pages=1000)
    prefix = to_cache_keys([TextToken(BOS), ImageToken(12345, 729)])
    prefix_pages = s.table.allocate_pages(730)
    s.tree.insert(prefix, prefix_pages)
    full = [*prefix, *range(10)]
    suffix_pages = s.table.allocate_pages(10)
    match = s.tree.match(full)
    assert match.length == 730
    result = s.tree.insert(full, prefix_pages + suffix_pages, from_node=match.last_node)
    assert result.inserted_pages == 10
    assert list(result.node.pages) == list(suffix_pages)
    assert result.node.start == 730
    s.check()
