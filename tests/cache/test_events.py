"""KV events: numbered, fanned out, replayable into an index that detects gaps."""

from __future__ import annotations

import pytest

from cache import BlockSetIndex, KvEvent, KvEventKind, KvEventPublisher
from tests.cache.helpers import make_stack


def test_events_are_numbered_and_reach_every_subscriber_in_order() -> None:
    pub = KvEventPublisher("w0")
    got_a: list[KvEvent] = []
    got_b: list[KvEvent] = []
    pub.subscribe(got_a.append)
    unsubscribe_b = pub.subscribe(got_b.append)
    pub.publish(KvEventKind.STORED, [1, 2])
    unsubscribe_b()
    pub.publish(KvEventKind.REMOVED, [2])
    assert [(e.seq, e.kind, e.block_hashes) for e in got_a] == [
        (1, KvEventKind.STORED, (1, 2)),
        (2, KvEventKind.REMOVED, (2,)),
    ]
    assert [e.seq for e in got_b] == [1]
    assert pub.publish(KvEventKind.STORED, []) is None  # nothing to say: no number spent
    assert pub.publish(KvEventKind.CLEARED) is not None
    assert pub.seq == 3


def test_index_applies_in_order_and_detects_a_gap() -> None:
    index = BlockSetIndex("w0")
    assert index.apply(KvEvent("w0", 1, KvEventKind.STORED, (1, 2, 3)))
    assert index.apply(KvEvent("w0", 2, KvEventKind.REMOVED, (2,)))
    assert index.blocks == {1, 3}
    assert index.apply(KvEvent("w0", 2, KvEventKind.REMOVED, (1,)))  # a redelivery: ignored
    assert index.blocks == {1, 3}
    assert not index.apply(KvEvent("w0", 4, KvEventKind.STORED, (9,)))  # 3 is missing
    assert not index.in_sync
    assert not index.apply(KvEvent("w0", 5, KvEventKind.STORED, (10,)))
    assert 9 not in index.blocks and 10 not in index.blocks
    with pytest.raises(ValueError, match="w1"):
        index.apply(KvEvent("w1", 1, KvEventKind.STORED, (1,)))


def test_snapshot_then_later_events_reproduce_the_tree() -> None:
    s = make_stack(num_pages=64, block_size=2)
    s.tree.insert(list(range(10)), s.table.allocate_pages(10))
    snapshot = s.tree.snapshot()
    index = BlockSetIndex("test")
    index.in_sync = False
    index.load_snapshot(snapshot)
    s.events.subscribe(index.apply)
    s.tree.insert([*range(6), 50, 51, 52, 53], s.table.allocate_pages(10))
    assert len(index.blocks) == 7  # 5 blocks of the first sequence, 2 new ones of the second
    s.tree.evict(3)  # the older tail [7, 8, 9] goes: blocks (6, 7) and (8, 9)
    assert index.in_sync
    assert index.blocks == s.tree.block_set()
    assert len(index.blocks) == 5
    s.check()


def test_tree_publishes_stored_removed_and_cleared() -> None:
    s = make_stack(num_pages=64, block_size=4)
    events: list[KvEvent] = []
    s.events.subscribe(events.append)
    s.tree.insert(list(range(10)), s.table.allocate_pages(10))  # blocks 0-3, 4-7
    stored = events[-1]
    assert stored.kind is KvEventKind.STORED and len(stored.block_hashes) == 2
    s.tree.insert(list(range(12)), s.table.allocate_pages(12))  # the tree gains 8..11: block 8-11
    assert events[-1].kind is KvEventKind.STORED and len(events[-1].block_hashes) == 1
    s.tree.evict(2)  # trims positions 10, 11: block 8-11 is gone, 4-7 stays
    assert events[-1].kind is KvEventKind.REMOVED
    assert events[-1].block_hashes == events[1].block_hashes
    s.tree.clear()
    assert events[-1].kind is KvEventKind.CLEARED
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
