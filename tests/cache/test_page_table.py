"""The page table: sequential mapping, slots, erase of the private tail, eviction on demand."""

from __future__ import annotations

import pytest

from cache import OutOfPages, OutOfSlots, PageMappingError
from cache.page_pool import FREE
from tests.cache.helpers import make_stack


def test_map_is_sequential_and_refuses_gaps_and_overlaps() -> None:
    s = make_stack()
    slot = s.table.allocate()
    pages = s.table.allocate_pages(4)
    s.table.map_pages(slot, 0, pages[:2])
    with pytest.raises(PageMappingError, match="sequential"):
        s.table.map_pages(slot, 3, pages[2:])
    with pytest.raises(PageMappingError, match="sequential"):
        s.table.map_pages(slot, 1, pages[2:])
    assert s.table.get_pages(slot, 0, 2) == list(pages[:2])  # unchanged by the refusals
    s.table.map_pages(slot, 2, pages[2:])
    assert list(s.table.row(slot)) == list(pages)


def test_unallocated_pages_and_slots_cannot_be_used() -> None:
    s = make_stack()
    slot = s.table.allocate()
    with pytest.raises(PageMappingError, match="not allocated"):
        s.table.map_pages(slot, 0, [5])
    with pytest.raises(PageMappingError, match="slot 7 is not allocated"):
        s.table.get_pages(7, 0, 0)
    with pytest.raises(PageMappingError, match="outside"):
        s.table.get_pages(slot, 0, 1)


def test_erase_frees_only_the_private_tail() -> None:
    s = make_stack()
    cached = s.table.allocate_pages(2)
    s.tree.insert([1, 2], cached)
    slot = s.table.allocate()
    s.table.map_pages(slot, 0, cached)
    private = s.table.allocate_pages(3)
    s.table.map_pages(slot, 2, private)
    with pytest.raises(PageMappingError, match="cached_page_count 6"):
        s.table.erase(slot, 6)
    s.table.erase(slot, 2)
    assert all(s.pool.state(p) == FREE for p in private)
    assert s.tree.cached_pages == 2
    assert s.table.active_slots == []
    s.check()


def test_slots_run_out_with_a_typed_error() -> None:
    s = make_stack(max_slots=2)
    s.table.allocate()
    s.table.allocate()
    with pytest.raises(OutOfSlots, match="all 2"):
        s.table.allocate()


def test_allocation_evicts_unlocked_cache_pages_on_demand() -> None:
    s = make_stack(num_pages=11)
    node = s.tree.insert(list(range(6)), s.table.allocate_pages(6)).node
    s.tree.lock(node)
    s.tree.insert([100, 101, 102], s.table.allocate_pages(3))
    assert s.pool.num_free == 1
    assert s.table.can_reserve_with_eviction(4)
    assert not s.table.can_reserve_with_eviction(5)
    with pytest.raises(OutOfPages) as err:
        s.table.allocate_pages(5)
    assert (err.value.free, err.value.evictable) == (1, 3)
    assert s.tree.cached_pages == 9  # the refused allocation evicted nothing
    got = s.table.allocate_pages(4)
    assert len(got) == 4 and s.tree.cached_pages == 6
    s.check()
