"""The exact block index: KV events (stored / removed / cleared), gaps, snapshots, removal."""

from __future__ import annotations

import random

from cache import KvEvent, KvEventKind, KvSnapshot
from router.block_index import BlockIndex
from router.cache_aware import CacheAware
from tests.router.helpers import CONFIG, Clock, Worker, prompt, request

STORED, REMOVED, CLEARED = KvEventKind.STORED, KvEventKind.REMOVED, KvEventKind.CLEARED


def index_of(*workers: str) -> BlockIndex:
    index = BlockIndex()
    for bit, worker in enumerate(workers):
        index.add(worker, bit)
    return index


def test_stored_removed_cleared() -> None:
    index = index_of("a", "b")
    assert index.apply("a", KvEvent("a", 1, STORED, (1, 2, 3)))
    assert index.apply("b", KvEvent("b", 1, STORED, (1, 2)))
    assert index.holders == {1: 0b11, 2: 0b11, 3: 0b01}
    assert index.apply("a", KvEvent("a", 2, REMOVED, (3, 2)))
    assert index.holders == {1: 0b11, 2: 0b10}
    assert index.apply("b", KvEvent("b", 2, CLEARED, ()))
    assert index.holders == {1: 0b01}
    assert index.blocks("a") == 1 and index.blocks("b") == 0


def test_gap_stops_the_index_until_a_snapshot() -> None:
    index = index_of("a")
    assert index.apply("a", KvEvent("a", 1, STORED, (1, 2)))
    assert not index.apply("a", KvEvent("a", 3, STORED, (7,)))  # event 2 was lost
    assert not index.in_sync("a")
    assert not index.apply("a", KvEvent("a", 4, REMOVED, (1,)))  # ignored while out of sync
    assert index.holders == {1: 1, 2: 1}
    index.load_snapshot("a", KvSnapshot("a", 4, frozenset({2, 7})))
    assert index.in_sync("a") and index.holders == {2: 1, 7: 1}
    assert index.apply("a", KvEvent("a", 4, STORED, (99,)))  # a redelivery: already reflected
    assert index.apply("a", KvEvent("a", 5, STORED, (8,)))
    assert index.holders == {2: 1, 7: 1, 8: 1}


def test_removing_a_worker_drops_only_its_blocks_and_its_bit_is_reused_clean() -> None:
    index = index_of("a", "b")
    index.apply("a", KvEvent("a", 1, STORED, (1, 2, 3)))
    index.apply("b", KvEvent("b", 1, STORED, (2, 9)))
    index.remove("a")
    assert index.holders == {2: 0b10, 9: 0b10}
    index.add("c", 0)  # reuses a's bit: must not inherit a's blocks
    assert index.depth(0, (1, 2, 3)) == 0 and index.blocks("c") == 0


def test_index_equals_the_workers_tree_through_eviction() -> None:
    """Events of a real cache under eviction pressure rebuild exactly its block set."""
    rng = random.Random(7)
    worker = Worker("w0", capacity=300)
    policy = CacheAware(CONFIG, Clock())
    policy.add_worker("w0", 300)
    systems = [prompt(s, 40) for s in range(6)]
    for i in range(300):
        worker.serve(prompt(1000 + i, rng.randint(44, 120), rng.choice(systems)))
        worker.deliver(policy)
    expected = worker.cache.tree.block_set()
    assert {b for b, mask in policy.index.holders.items() if mask & 1} == expected
    assert worker.cache.tree.evicted_pages > 0 and len(expected) > 10


def test_policy_resyncs_from_a_snapshot_after_a_gap() -> None:
    worker = Worker("w0")
    policy = CacheAware(CONFIG, Clock())
    policy.add_worker("w0", 4096)
    worker.serve(prompt(1, 40))
    worker.serve(prompt(2, 40))
    first, second = worker.events
    assert policy.apply_event("w0", first)
    worker.serve(prompt(3, 40))
    assert not policy.apply_event("w0", worker.events[2])  # `second` never arrived
    policy.load_snapshot("w0", worker.cache.tree.snapshot())
    held = request("r", prompt(2, 40))
    assert policy.index.depth(0, held.block_hashes) == len(held.block_hashes)
    del second
