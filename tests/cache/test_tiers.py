"""The host tier: what eviction, match, promote and insert do with a node's pages across tiers.

Each test builds a device pool and a host pool, caches sequences, and checks the tree, both
pools, the queued `TierCopy`s and the KV events after every operation.
"""

from __future__ import annotations

from array import array

import pytest

from cache import (
    BlockHasher,
    CacheConfig,
    IdentityScheme,
    KvEvent,
    KvEventKind,
    KvEventPublisher,
    PagePool,
    RadixCache,
    SequenceCache,
)
from cache.integrity import check_sequence_cache, check_tree
from cache.page_pool import CACHED, FREE
from cache.tiers import DEVICE, HOST, SpillCopy, TierCopy


class Tiers:
    """A tree over a device pool and a host pool, with its events recorded."""

    def __init__(self, device_pages: int, host_pages: int, page_size: int = 1) -> None:
        self.device = PagePool(device_pages, page_size)
        self.host = PagePool(host_pages, page_size)
        self.events: list[KvEvent] = []
        publisher = KvEventPublisher("tiers")
        publisher.subscribe(self.events.append)
        hasher = BlockHasher(IdentityScheme(4 * page_size, "tiers"))
        self.tree = RadixCache(self.device, hasher, publisher, self.host)

    def cache(self, keys: list[int]) -> None:
        """Compute `keys` on fresh device pages and insert them."""
        ps = self.tree.page_size
        pages = self.device.allocate(len(keys) // ps)
        result = self.tree.insert(keys, pages)
        self.device.free_private(pages[: len(result.existing_pages)])  # duplicates of the tree's

    def check(self) -> None:
        check_tree(self.tree)

    def kinds(self) -> list[KvEventKind]:
        return [event.kind for event in self.events]


def test_eviction_moves_pages_to_the_host_and_a_match_finds_them_there() -> None:
    t = Tiers(10, 20)
    t.cache(list(range(100, 108)))
    device_pages = t.tree.match(list(range(100, 108))).pages
    t.events.clear()
    assert t.tree.evict(8) == 8
    t.check()
    assert (t.tree.cached_pages, t.tree.host_cached_pages, t.device.num_free) == (0, 8, 9)
    (copy,) = t.tree.take_copies()
    assert (copy.src_tier, copy.dst_tier) == (DEVICE, HOST)
    assert list(copy.src_pages) == list(device_pages)
    assert all(t.host.state(page) == CACHED for page in copy.dst_pages)
    (demoted,) = t.events  # still cached, now on the host
    assert demoted.kind is KvEventKind.DEMOTED and len(demoted.block_hashes) == 2
    match = t.tree.match([*range(100, 108), 5])
    assert (match.length, match.last_node, match.host_length) == (0, None, 8)
    assert match.host_node is not None and match.host_node.tier == HOST


def test_promote_copies_the_pages_back_and_frees_the_host() -> None:
    t = Tiers(10, 20)
    t.cache(list(range(100, 108)))
    t.tree.evict(8)
    (down,) = t.tree.take_copies()
    promoted = t.tree.promote(t.tree.match(list(range(100, 108))))
    t.check()
    assert (promoted.length, promoted.host_length, promoted.host_node) == (8, 0, None)
    assert promoted.last_node is not None and promoted.last_node.tier == DEVICE
    (up,) = t.tree.take_copies()
    assert (up.src_tier, up.dst_tier) == (HOST, DEVICE)
    assert list(up.src_pages) == list(down.dst_pages), "it reads what the demotion wrote"
    assert list(up.dst_pages) == list(promoted.pages)
    assert t.host.num_cached == 0 and t.tree.promoted_pages == 8
    assert len(promoted.block_hashes) == 2, "the blocks come back with the pages"
    assert t.events[-1].kind is KvEventKind.PROMOTED
    assert t.events[-1].block_hashes == tuple(promoted.block_hashes)


def test_a_full_host_drops_its_least_recently_used_leaf() -> None:
    t = Tiers(9, 9)  # 8 usable pages a tier
    t.cache([1, 2, 3, 4])
    t.cache([5, 6, 7, 8])
    t.tree.match([5, 6, 7, 8])  # used after [1, 2, 3, 4]
    t.tree.evict(8)
    t.cache([9, 10, 11, 12])
    t.events.clear()
    t.tree.evict(4)  # the host makes room by dropping [1, 2, 3, 4], its oldest
    t.check()
    assert t.tree.match([1, 2, 3, 4]).host_length == 0
    assert t.tree.match([5, 6, 7, 8]).host_length == 4
    assert t.tree.match([9, 10, 11, 12]).host_length == 4
    assert t.kinds() == [KvEventKind.REMOVED, KvEventKind.DEMOTED], "the drop first"
    assert len(t.events[0].block_hashes) == 1 and len(t.events[1].block_hashes) == 1
    assert t.tree.host_evicted_pages == 4


def test_a_node_bigger_than_the_host_is_dropped_with_everything_below_it() -> None:
    t = Tiers(20, 5)  # 4 usable host pages
    t.cache(list(range(1, 10)))
    t.tree.evict(4)  # the tail [5, 9) of 4 pages fits the host; the head [0, 5) stays
    t.check()
    head = t.tree.match(list(range(1, 10)))
    assert (head.length, head.host_length) == (5, 4)
    t.events.clear()
    assert t.tree.evict(5) == 5  # 5 pages cannot go to a 4-page host: dropped, and its child
    t.check()
    assert t.tree.node_count == 0 and t.host.num_free == 4 and t.device.num_free == 19
    (removed,) = t.events
    assert removed.kind is KvEventKind.REMOVED and len(removed.block_hashes) == 2


def test_an_insert_over_host_positions_takes_the_callers_pages_without_a_copy() -> None:
    t = Tiers(14, 20)
    t.cache(list(range(100, 108)))
    t.tree.evict(8)
    t.tree.take_copies()
    t.events.clear()
    keys = [*range(100, 108), 1, 2, 3, 4]
    fresh = t.device.allocate(12)
    result = t.tree.insert(keys, fresh)
    t.check()
    assert (result.inserted_pages, len(result.existing_pages)) == (12, 0)
    assert t.tree.take_copies() == [], "the caller computed them: nothing to copy"
    assert t.tree.adopted_pages == 8 and t.host.num_free == t.host.usable_pages
    assert list(t.tree.match(keys).pages) == list(fresh)
    assert t.kinds() == [KvEventKind.PROMOTED, KvEventKind.STORED]
    assert len(t.events[0].block_hashes) == 2, "the adopted blocks are back on the device"
    assert len(t.events[1].block_hashes) == 1, "only the new block is stored"


def test_an_insert_over_host_positions_with_pages_not_private_changes_nothing() -> None:
    t = Tiers(10, 20)
    t.cache(list(range(100, 108)))
    t.tree.evict(8)
    pages = array("i", range(1, 9))
    assert all(t.device.state(p) == FREE for p in pages)
    with pytest.raises(Exception, match="expected private"):
        t.tree.insert(list(range(100, 108)), pages)
    t.check()
    assert t.tree.host_cached_pages == 8


def test_promotion_is_refused_when_the_device_cannot_hold_it() -> None:
    t = Tiers(9, 20)  # 8 usable device pages
    t.cache(list(range(100, 108)))
    t.tree.evict(8)
    t.tree.take_copies()
    held = t.device.allocate(3)  # a running sequence's private pages
    match = t.tree.match(list(range(100, 108)))
    assert t.tree.promote(match) is match, "8 pages do not fit in the 5 free"
    assert t.tree.take_copies() == [] and t.tree.host_cached_pages == 8, "nothing moved"
    head = t.tree.match(list(range(100, 104)))  # 4 pages fit, and 1 more, but not 3 more
    assert t.tree.promote(head, spare=3) is head
    assert t.tree.promote(head, spare=1).length == 4
    t.device.free_private(held)
    t.check()


def test_promotion_leaves_room_for_the_rest_of_the_start_or_does_not_happen() -> None:
    t = Tiers(9, 20)
    t.cache(list(range(100, 106)))
    t.tree.evict(6)
    t.tree.take_copies()
    match = t.tree.match(list(range(100, 106)))
    assert t.tree.promote(match, spare=3) is match, "6 + 3 pages do not fit in 8"
    assert t.tree.take_copies() == []
    assert t.tree.promote(match, spare=2).length == 6
    t.check()


def test_a_sequence_reuses_promoted_pages_and_counts_them() -> None:
    cache = SequenceCache(CacheConfig(40, 4, 4, 4, host_pages=40))
    prompt = list(range(200, 221))
    seq = cache.start(prompt)
    cache.take_page_copies(seq)
    cache.finish(seq, len(prompt))
    cache.tree.evict(cache.tree.evictable_pages)
    seq = cache.start(prompt)
    copies = cache.take_page_copies(seq)
    check_sequence_cache(cache)
    assert seq.reused == 20 and cache.stats.host_positions == 20
    assert isinstance(copies[0], TierCopy) and copies[0].src_tier == DEVICE, "the demotion first"
    assert isinstance(copies[1], TierCopy) and copies[1].src_tier == HOST, "then the promotion"
    cache.abort(seq)
    check_sequence_cache(cache)


def test_host_pages_are_configured_and_checked() -> None:
    with pytest.raises(ValueError, match="host_pages"):
        CacheConfig(10, host_pages=1)
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(PagePool(10, 4), host_pool=PagePool(10, 8))
    without = SequenceCache(CacheConfig(10))
    assert without.host_pool is None
    with pytest.raises(ValueError, match="pairs pages"):
        TierCopy(DEVICE, array("i", [1]), HOST, array("i", []))


def test_a_promotion_survives_its_own_eviction_merging_the_path() -> None:
    """Making room on the device demotes, which drops a host leaf, which leaves a node of the
    path being promoted with one child: the two merge mid-promotion (found by router_sim on
    the Mooncake trace)."""
    t = Tiers(9, 9)  # 8 usable pages a tier
    t.cache([1, 2, 3, 4])
    t.cache([1, 2, 5, 6])  # [1, 2] with children [3, 4] and [5, 6]
    t.tree.evict(6)  # all on the host: 6 of 8 host pages
    t.tree.match([1, 2, 3, 4])  # [5, 6] is now the least recently used host leaf
    t.cache(list(range(20, 28)))  # the device is full
    t.tree.take_copies()
    promoted = t.tree.promote(t.tree.match([1, 2, 3, 4]))
    t.check()
    assert promoted.length == 4 and list(promoted.pages) == list(t.tree.match([1, 2, 3, 4]).pages)
    assert t.tree.match([1, 2, 5, 6]).length + t.tree.match([1, 2, 5, 6]).host_length == 2
    copies = t.tree.take_copies()
    assert [(c.src_tier, c.dst_tier, len(c.src_pages)) for c in copies] == [
        (DEVICE, HOST, 4),
        (HOST, DEVICE, 4),
    ]


def spills(tree: RadixCache) -> list[tuple[list[int], int]]:
    """Take every node the tree drops, and the path above it: records (keys, tier) of each."""
    offered: list[tuple[list[int], int]] = []

    def whole_path(node):  # type: ignore[no-untyped-def]
        kept = []
        while node.parent is not None:
            offered.append((list(node.keys), node.tier))
            kept.append((node, list(node.keys)))
            node = node.parent
        return kept

    tree.on_drop = whole_path
    return offered


def test_a_host_drop_spills_its_pages_before_the_demotion_that_reuses_them() -> None:
    t = Tiers(9, 9)  # 8 usable pages a tier
    offered = spills(t.tree)
    t.cache([1, 2, 3, 4])
    t.cache([5, 6, 7, 8])
    t.tree.match([5, 6, 7, 8])
    t.tree.evict(8)
    t.cache([9, 10, 11, 12])
    t.tree.take_copies()
    t.tree.evict(4)  # drops [1, 2, 3, 4] from the host, then demotes [9, 12] into its pages
    t.check()
    assert offered == [([1, 2, 3, 4], HOST)]
    spill, demotion = t.tree.take_copies()
    assert isinstance(spill, SpillCopy) and isinstance(demotion, TierCopy)
    assert (spill.tier, spill.token) == (HOST, [1, 2, 3, 4])
    assert set(spill.pages) == set(demotion.dst_pages), "the freed host pages, read first"
    assert t.tree.spilled_pages == 4


def test_a_spilling_tree_drops_whole_leaves_and_spills_each_page_once() -> None:
    """Without a host: the dropped leaf goes whole (no trim, no split that would leave a new
    head to spill again), with the unsaved path above it."""
    device = PagePool(20, 1)
    tree = RadixCache(device)
    offered = spills(tree)
    for keys in (list(range(1, 9)), [*range(1, 5), 50, 51, 52, 53]):  # a shared head of 4
        pages = device.allocate(8)
        device.free_private(pages[: len(tree.insert(keys, pages).existing_pages)])
    assert tree.evict(2) == 4, "the whole least recently used leaf"
    check_tree(tree)
    assert offered == [([5, 6, 7, 8], DEVICE), ([1, 2, 3, 4], DEVICE)]
    copies = tree.take_copies()
    assert all(isinstance(c, SpillCopy) for c in copies)
    assert [len(c.pages) for c in copies] == [4, 4]  # type: ignore[union-attr]
    assert tree.node_count == 1, "the head merged into the other leaf"


def test_a_host_leaf_eaten_a_page_at_a_time_is_spilled_once() -> None:
    t = Tiers(70, 70)
    offered = spills(t.tree)
    t.cache(list(range(1, 65)))  # one node of 64 pages
    t.tree.evict(64)  # to the host, whole
    for i in range(64):  # demotions needing one host page each
        t.cache([1000 + i])
        t.tree.evict(1)
    t.check()
    assert [len(keys) for keys, _ in offered][:1] == [64], "dropped whole, at the first need"
    assert sum(len(c.pages) for c in t.tree.take_copies() if isinstance(c, SpillCopy)) <= 2 * 64


def test_clear_and_dropping_namespaces_spill_nothing() -> None:
    t = Tiers(20, 8)
    offered = spills(t.tree)
    t.cache(list(range(1, 9)))
    t.tree.drop_namespaces(lambda ns: True)
    t.cache(list(range(1, 9)))
    t.tree.clear()
    assert offered == [] and t.tree.take_copies() == [] and t.tree.spilled_pages == 0


def test_a_device_leaf_eaten_a_page_at_a_time_over_a_host_is_spilled_once() -> None:
    """With a host tier too: a demoted leaf goes whole, so no head left on the device is
    renamed by a split and spilled again under each tail the host drops later."""
    t = Tiers(70, 5)  # 4 usable host pages: the host drops most of what comes down
    offered = spills(t.tree)
    t.cache(list(range(1, 65)))  # one device node of 64 pages
    for i in range(64):  # decodes growing a page each
        t.cache([1000 + i])
        t.tree.evict(1)
        t.check()
    spilled = sum(len(c.pages) for c in t.tree.take_copies() if isinstance(c, SpillCopy))
    assert spilled <= 2 * 64 + 64, f"{spilled} pages spilled for at most 128 dropped"
    assert offered, "the host dropped something"
