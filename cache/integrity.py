"""Executable invariants of the pool, the tree and the sequences (raise AssertionError).

Cheap enough for tests after every operation and for the engine when idle in debug mode; far
too slow for every step of a serving loop (they walk everything).
"""

from __future__ import annotations

from cache.page_pool import CACHED, FREE, PRIVATE, PagePool
from cache.radix_cache import RadixCache
from cache.radix_node import Node
from cache.sequences import SequenceCache
from cache.tiers import DEVICE, HOST


def check_tree(tree: RadixCache) -> None:
    """Structure, page ownership per tier, lock counts, the evictable count and both LRU heaps."""
    pool, host, ps = tree.pool, tree.host_pool, tree.page_size
    block_size = tree.hasher.block_size if tree.hasher else None
    seen_pages: dict[int, set[int]] = {DEVICE: set(), HOST: set()}
    nodes = cached = locked = on_host = 0
    for namespace, root in tree.roots.items():
        assert root.namespace == namespace and root.parent is None and not root.keys
        assert root.children, f"empty root of {namespace} was not pruned"
        assert root.lock_ref == sum(c.lock_ref for c in root.children.values()), "root lock_ref"
        for node in _subtree(root):
            nodes += 1
            _check_node(tree, node, ps, block_size)
            if node.tier == DEVICE:
                cached += len(node.pages)
                locked += len(node.pages) if node.lock_ref > 0 else 0
                owner = pool
            else:
                assert node.tier == HOST and host is not None, f"{node!r}: tier without a pool"
                assert node.lock_ref == 0, f"host node {node!r} is locked"
                on_host += len(node.pages)
                owner = host
            for page in node.pages:
                assert page not in seen_pages[node.tier], f"page {page} is owned by two nodes"
                assert owner.state(page) == CACHED, f"tree page {page} is not in state cached"
                seen_pages[node.tier].add(page)
    assert nodes == tree.node_count, f"node_count {tree.node_count}, reachable nodes {nodes}"
    assert cached == tree.cached_pages == pool.num_cached, (cached, tree.cached_pages)
    assert locked == tree.locked_pages, f"locked_pages {tree.locked_pages}, counted {locked}"
    if host is not None:
        host.check()
        assert on_host == tree.host_cached_pages == host.num_cached, (on_host, host.num_cached)
        assert host.num_private == 0, f"{host.num_private} host pages are in flight"
        assert host.num_free + host.num_cached == host.usable_pages, "host pages leaked"
    else:
        assert on_host == tree.host_cached_pages == 0
    heap = {id(n) for n in tree.heap_nodes()}
    host_heap = {id(n) for n in tree.host_heap_nodes()}
    for node in tree.nodes():
        if node.lock_ref:
            continue
        if node.tier == DEVICE and all(c.tier != DEVICE for c in node.children.values()):
            assert id(node) in heap, f"evictable device node {node!r} has no current heap entry"
        if node.tier == HOST and not node.children:
            assert id(node) in host_heap, f"host leaf {node!r} has no current heap entry"


def _subtree(root: Node) -> list[Node]:
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def _check_node(tree: RadixCache, node: Node, ps: int, block_size: int | None) -> None:
    parent = node.parent
    assert parent is not None and not node.is_root()
    assert node.keys and len(node.keys) % ps == 0, f"{node!r} is not whole pages"
    assert len(node.pages) * ps == len(node.keys), f"{node!r}: pages and keys disagree"
    assert node.start == parent.end, f"{node!r} does not start where its parent ends"
    key = node.keys[0] if ps == 1 else node.keys[:ps].tobytes()
    assert parent.children.get(key) is node, f"{node!r} is filed under the wrong key"
    assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0
    if node.tier == DEVICE:
        assert parent.is_root() or parent.tier == DEVICE, f"{node!r}: on the device, below host"
    assert node.last_access <= parent.last_access or parent.is_root(), "LRU order broken"
    if block_size is not None:
        want = node.end // block_size - node.start // block_size
        assert len(node.blocks) == want, f"{node!r} owns {len(node.blocks)} blocks, not {want}"


def check_pool(pool: PagePool) -> None:
    pool.check()


def check_sequence_cache(cache: SequenceCache) -> None:
    """Everything above, plus: each live sequence's row, exact lock counts, and conservation

    free + cache-owned + private == total pages - 1, with no page in two states, on the device
    and on the host (where nothing is private between operations).
    """
    pool, tree, table, ps = cache.pool, cache.tree, cache.table, cache.page_size
    pool.check()
    check_tree(tree)
    own_locks: dict[int, int] = {}
    private: set[int] = set()
    live = cache.live
    assert sorted(s.slot for s in live) == sorted(table.active_slots), "slots and sequences"
    for seq in live:
        row = list(table.row(seq.slot))
        node = seq.lock_node
        assert seq.cached_pages <= len(row)
        if node is not None:
            own_locks[id(node)] = own_locks.get(id(node), 0) + 1
            path = _path_pages(node)
            assert row[: seq.cached_pages] == path[: seq.cached_pages], "row is not the path"
        else:
            assert seq.cached_pages == 0, "cached pages without a lock"
        for page in row[seq.cached_pages :]:
            assert pool.state(page) == PRIVATE, f"page {page} of slot {seq.slot} is not private"
            assert page not in private, f"private page {page} is mapped by two sequences"
            private.add(page)
        assert seq.computed <= len(row) * ps and seq.computed <= len(seq.keys)
    assert len(private) == pool.num_private, f"{pool.num_private} private, {len(private)} mapped"
    for node in tree.nodes():
        want = own_locks.get(id(node), 0) + sum(c.lock_ref for c in node.children.values())
        assert node.lock_ref == want, f"{node!r} lock_ref {node.lock_ref}, expected {want}"
    free = sum(1 for p in range(1, pool.num_pages) if pool.state(p) == FREE)
    assert free + tree.cached_pages + len(private) == pool.num_pages - 1, "pages leaked"


def _path_pages(node: Node) -> list[int]:
    chain = []
    current: Node | None = node
    while current is not None and not current.is_root():
        chain.append(current.pages)
        current = current.parent
    return [page for pages in reversed(chain) for page in pages]
