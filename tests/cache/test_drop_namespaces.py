"""Dropping whole namespaces (an unloaded adapter's trees): every page of theirs, on both tiers,
goes back to its pool and every block of theirs is published as removed; nothing else moves."""

from __future__ import annotations

import pytest

from cache import (
    BlockSetIndex,
    CacheConfig,
    CacheError,
    CacheNamespace,
    KvEvent,
    KvEventKind,
    SequenceCache,
)
from cache.integrity import check_sequence_cache
from cache.tiers import HOST

PROMPT = list(range(1, 34))
BASE = CacheNamespace()
A = CacheNamespace(adapter="a@0001")
A_ACME = CacheNamespace(adapter="a@0001", tenant="acme")
B = CacheNamespace(adapter="b@0002")


def _cache(host_pages: int = 0, page_size: int = 4) -> tuple[SequenceCache, list[KvEvent]]:
    cache = SequenceCache(CacheConfig(64, page_size, 4, 4, host_pages=host_pages), "drop")
    events: list[KvEvent] = []
    cache.events.subscribe(events.append)
    return cache, events


def _run(cache: SequenceCache, namespace: CacheNamespace, prompt: list[int] = PROMPT) -> None:
    seq = cache.start(prompt, namespace)
    cache.finish(seq, len(prompt))


def _blocks(cache: SequenceCache, namespace: CacheNamespace) -> set[int]:
    root = cache.tree.roots.get(namespace)
    if root is None:
        return set()
    out: set[int] = set()
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        out.update(node.blocks)
        stack.extend(node.children.values())
    return out


def test_dropping_an_adapter_frees_its_trees_of_every_tenant_and_nothing_else() -> None:
    cache, events = _cache()
    index = BlockSetIndex("drop")
    cache.events.subscribe(index.apply)  # type: ignore[arg-type]
    for namespace in (BASE, A, A_ACME, B):
        _run(cache, namespace)
    check_sequence_cache(cache)
    dropped = _blocks(cache, A) | _blocks(cache, A_ACME)
    kept = {ns: _blocks(cache, ns) for ns in (BASE, B)}
    assert dropped and not dropped & (kept[BASE] | kept[B])
    per_tree = cache.tree.cached_pages // 4
    free_before = cache.pool.num_free
    events.clear()

    freed = cache.drop_namespaces(lambda ns: ns.adapter == "a@0001")

    assert freed == 2 * per_tree == cache.pool.num_free - free_before
    assert set(cache.tree.roots) == {BASE, B}
    assert [e.kind for e in events] == [KvEventKind.REMOVED]
    assert set(events[0].block_hashes) == dropped
    assert index.in_sync and index.blocks == kept[BASE] | kept[B] == cache.tree.block_set()
    check_sequence_cache(cache)
    # the others still hit; the dropped one misses
    for namespace, hit in ((BASE, True), (B, True), (A, False)):
        seq = cache.start(PROMPT, namespace)
        assert (seq.reused > 0) is hit, namespace
        cache.abort(seq)
    check_sequence_cache(cache)


def test_a_set_of_namespaces_selects_exactly_those() -> None:
    cache, _ = _cache()
    for namespace in (BASE, A, A_ACME):
        _run(cache, namespace)
    cache.drop_namespaces({A_ACME, CacheNamespace(adapter="nobody")})
    assert set(cache.tree.roots) == {BASE, A}
    check_sequence_cache(cache)


def test_host_resident_nodes_are_dropped_too() -> None:
    cache, events = _cache(host_pages=40)
    _run(cache, A)
    _run(cache, BASE, [7, *PROMPT])
    cache.tree.evict(cache.tree.evictable_pages)  # everything to the host
    assert cache.tree.host_cached_pages == 2 * (32 // 4)
    _run(cache, A, PROMPT[:17])  # part of A back on the device, the rest still on the host
    assert any(n.tier == HOST for n in cache.tree.nodes())
    events.clear()
    host_free = cache.host_pool.num_free if cache.host_pool else 0

    cache.drop_namespaces({A})

    assert cache.host_pool is not None
    assert cache.host_pool.num_free - host_free > 0
    assert cache.tree.host_cached_pages == 32 // 4  # BASE's, still on the host
    assert set(cache.tree.roots) == {BASE}
    assert {e.kind for e in events} == {KvEventKind.REMOVED}
    check_sequence_cache(cache)
    # eviction still works over the heaps' stale entries of dropped nodes
    _run(cache, B)
    evictable = cache.tree.evictable_pages
    assert evictable > 0 and cache.tree.evict(evictable) == evictable
    check_sequence_cache(cache)


def test_a_namespace_in_use_is_refused_and_nothing_changes() -> None:
    cache, events = _cache()
    _run(cache, A)
    locked = cache.start(PROMPT, A)  # a hit: holds a lock on A's tree
    fresh = cache.start([9, 9, 9, 9, 9], B)  # a miss: no lock, but it will insert into B
    events.clear()
    cached = cache.tree.cached_pages
    with pytest.raises(CacheError, match="live sequences"):
        cache.drop_namespaces({A})
    with pytest.raises(CacheError, match="live sequences"):
        cache.drop_namespaces({B})
    with pytest.raises(CacheError, match="locks"):
        cache.tree.drop_namespaces({A})
    assert cache.tree.cached_pages == cached and not events
    check_sequence_cache(cache)
    cache.finish(locked, len(PROMPT))
    cache.abort(fresh)
    assert cache.drop_namespaces({A, B}) == cached
    assert cache.pool.num_free == cache.pool.usable_pages
    check_sequence_cache(cache)
