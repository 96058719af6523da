"""Radix tree behaviour beyond seed 000: whole pages, LRU order, tail trimming, coalescing."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cache import (
    BlockSetIndex,
    CacheConfig,
    ImageToken,
    KvEvent,
    KvEventKind,
    LengthMismatch,
    to_cache_keys,
)
from cache.radix_cache import _NUMPY_PREFIX_FROM, common_prefix
from tests.cache.helpers import make_stack


def test_page_size_16_matches_and_splits_on_page_boundaries() -> None:
    s = make_stack(num_pages=32, page_size=16)
    a = list(range(48))
    a_pages = s.table.allocate_pages(3)
    s.tree.insert(a, a_pages)
    b = [*range(20), *range(1000, 1028)]  # diverges at position 20, inside page 1
    match = s.tree.match(b)
    assert match.length == 16 and match.pages == a_pages[:1]
    b_pages = s.table.allocate_pages(3)
    result = s.tree.insert(b, b_pages)
    assert result.existing_pages == a_pages[:1] and result.inserted_pages == 2
    assert s.tree.match(a).length == 48 and s.tree.match(b).length == 48
    assert s.tree.match(a[:47]).length == 32  # a partial last page never matches
    s.table.free_pages_to_pool(b_pages[:1])  # the duplicate of a's first page
    s.check()


def test_siblings_that_differ_inside_their_first_page_coexist() -> None:
    s = make_stack(num_pages=32, page_size=16)
    a, b = list(range(32)), [*range(8), *range(500, 524)]
    s.tree.insert(a, s.table.allocate_pages(2))
    s.tree.insert(b, s.table.allocate_pages(2))
    assert s.tree.match(a).length == 32 and s.tree.match(b).length == 32
    assert len(s.tree.roots[next(iter(s.tree.roots))].children) == 2
    s.check()


def test_insert_refuses_keys_and_pages_that_disagree() -> None:
    s = make_stack(num_pages=32, page_size=16)
    pages = s.table.allocate_pages(3)
    with pytest.raises(LengthMismatch, match="3 pages of 16"):
        s.tree.insert(list(range(40)), pages)
    with pytest.raises(LengthMismatch, match="3 pages of 16"):
        s.tree.insert(list(range(32)), pages)
    with pytest.raises(LengthMismatch, match="empty"):
        s.tree.insert([], [])
    assert s.tree.cached_pages == 0 and len(s.tree.roots) == 0
    s.check()


def test_least_recently_used_leaf_is_evicted_first() -> None:
    s = make_stack()
    old, mid, new = [1, 2, 3], [4, 5, 6], [7, 8, 9]
    for seq in (old, mid, new):
        s.tree.insert(seq, s.table.allocate_pages(3))
    s.tree.match(old)  # old is now the most recent
    assert s.tree.evict(3) == 3
    assert s.tree.match(mid).length == 0
    assert s.tree.match(old).length == 3 and s.tree.match(new).length == 3
    s.check()


def test_eviction_trims_only_the_tail_it_needs() -> None:
    s = make_stack()
    seq = list(range(10))
    s.tree.insert(seq, s.table.allocate_pages(10))
    assert s.tree.evict(3) == 3
    assert s.tree.match(seq).length == 7
    assert s.tree.evict(0) == 0
    s.check()


def test_a_trimmed_leaf_keeps_its_head_and_frees_and_unpublishes_only_its_tail() -> None:
    """Eviction cuts the tail off its last victim in place: the head keeps its pages, its
    blocks and its place; the tail's pages go back to the pool (reused first) and exactly the
    tail's blocks are published as removed."""
    s = make_stack(num_pages=16, page_size=4)
    events: list[KvEvent] = []
    s.events.subscribe(events.append)
    keys = list(range(100, 140))
    pages = s.table.allocate_pages(10)
    s.tree.insert(keys, pages)
    (stored,) = events
    leaf, count = s.tree.match(keys).last_node, s.tree.node_count
    assert s.tree.evict(3) == 3
    assert s.tree.match(keys).last_node is leaf and s.tree.node_count == count
    assert leaf.pages == pages[:7] and leaf.blocks == stored.block_hashes[:7]
    assert events[-1].kind is KvEventKind.REMOVED
    assert events[-1].block_hashes == stored.block_hashes[7:]
    assert s.table.allocate_pages(3) == pages[7:]  # the freed tail, most recently freed first
    s.check()


def test_eviction_with_big_pages_frees_whole_pages() -> None:
    s = make_stack(num_pages=16, page_size=16)
    s.tree.insert(list(range(160)), s.table.allocate_pages(10))
    assert s.tree.evict(4) == 4
    assert s.tree.match(list(range(160))).length == 96
    s.check()


def test_coalescing_after_eviction() -> None:
    s = make_stack()
    first = s.table.allocate_pages(4)
    s.tree.insert([1, 2, 3, 4], first)
    second = s.table.allocate_pages(4)
    s.tree.insert([1, 2, 7, 8], second)
    s.table.free_pages_to_pool(second[:2])  # duplicates of [1, 2]
    assert s.tree.node_count == 3
    s.tree.evict(2)  # [3, 4] is older than [7, 8]
    assert s.tree.node_count == 1
    (node,) = s.tree.nodes()
    assert tuple(node.keys) == (1, 2, 7, 8) and list(node.pages) == list(first[:2] + second[2:])
    s.check()


def test_no_coalescing_across_a_lock_held_on_the_parent() -> None:
    s = make_stack()
    s.tree.insert([1, 2, 3, 4], s.table.allocate_pages(4))
    second = s.table.allocate_pages(4)
    s.tree.insert([1, 2, 7, 8], second)
    s.table.free_pages_to_pool(second[:2])
    parent = s.tree.match([1, 2]).last_node
    s.tree.lock(parent)
    s.tree.match([1, 2, 7, 8])
    s.tree.evict(2)
    assert s.tree.node_count == 2  # [1, 2] is held by someone: it stays a node of its own
    s.tree.unlock(parent)
    s.check()


def test_hot_leaf_does_not_grow_the_heap_without_bound() -> None:
    s = make_stack()
    s.tree.insert([1, 2, 3], s.table.allocate_pages(3))
    for _ in range(5000):
        s.tree.match([1, 2, 3])
    assert len(s.tree._heap) <= 4 * s.tree.node_count + 1025
    s.check()


def test_image_prefix_is_reused_up_to_the_last_whole_page() -> None:
    s = make_stack(num_pages=16, page_size=16)
    image = ImageToken(0xBEEF, 40)
    cached = to_cache_keys([1, image, *range(100, 123)])  # 64 positions
    s.tree.insert(cached, s.table.allocate_pages(4))
    query = to_cache_keys([1, image, 7, 7, 7, 7, 7])  # shares the 41 positions of BOS + image
    assert s.tree.match(query).length == 32  # two whole pages, the second ending inside the image
    s.check()


def test_evictable_count_matches_a_walk() -> None:
    s = make_stack()
    a = s.tree.insert([1, 2, 3, 4], s.table.allocate_pages(4)).node
    s.tree.insert([1, 2, 5], s.table.allocate_pages(3))
    s.tree.lock(a)
    walked = sum(len(n.pages) for n in s.tree.nodes() if n.lock_ref == 0)
    assert s.tree.evictable_pages == walked == 1
    s.tree.unlock(a)
    assert s.tree.evictable_pages == s.tree.cached_pages


def test_blocks_smaller_than_pages_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of page_size"):
        make_stack(page_size=16, block_size=8)
    with pytest.raises(ValueError, match="multiple of page_size"):
        CacheConfig(num_pages=8, page_size=16, block_size=24)


def test_siblings_diverging_inside_a_page_own_distinct_blocks() -> None:
    s = make_stack(num_pages=8, page_size=16, block_size=16)
    index = BlockSetIndex("test")
    s.events.subscribe(index.apply)
    s.tree.insert([*range(12), 1, 1, 1, 1], s.table.allocate_pages(1))
    s.tree.insert([*range(12), 2, 2, 2, 2], s.table.allocate_pages(1))
    s.tree.evict(1)
    assert index.blocks == s.tree.block_set() and len(index.blocks) == 1


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 700), st.integers(0, 700), st.integers(0, 700), st.integers(0, 40))
@example(_NUMPY_PREFIX_FROM + 44, _NUMPY_PREFIX_FROM + 43, 0, 5)  # numpy: the last key differs
@example(700, 0, 0, 40)  # numpy: the first key differs
@example(700, 500, 300, 7)  # numpy: a difference, then agreement again
@example(_NUMPY_PREFIX_FROM - 1, 200, 100, 3)  # bisection, just under the bar
def test_common_prefix_is_the_first_difference_on_both_sides_of_the_numpy_bar(
    length: int, cut: int, after: int, at: int
) -> None:
    """A label of `length` keys against keys that agree for `cut` of them, then differ once
    and agree again for `after` (a difference a memcmp of the wrong span would miss): labels
    on both sides of the `_NUMPY_PREFIX_FROM` keys from which numpy, not bisection, finds the
    difference."""
    label = array("Q", range(1, length + 1))
    keys = array("Q", [0] * at) + label[:cut] + array("Q", [0]) + label[cut + 1 : cut + 1 + after]
    expected = 0
    for ours, theirs in zip(label, keys[at:], strict=False):
        if ours != theirs:
            break
        expected += 1
    assert common_prefix(label, keys, at) == expected
