"""The radix prefix cache: one tree of position keys per namespace, over pages of the pool.

Contract (every operation runs on the one scheduler thread; nothing here is thread-safe):

- `match` finds the longest cached prefix, splitting the node where the match ends so that the
  result ends exactly on a node; it marks the path as used (LRU). It never creates a root.
- `insert` adds a sequence whose KV is in the caller's pages. It claims only the pages of
  positions the tree did not have and reports the tree's own pages for the rest, so two prefills
  of the same prefix cannot leak: the caller swaps its duplicates for the tree's and frees them.
- `lock` protects a node and its ancestors from eviction; `unlock` releases it and raises
  `LockUnderflow` (changing nothing) if there was no lock. Pages are valid only while locked.
- `evict(n)` frees at least `n` pages if it can, least recently used leaves first, trimming only
  the tail of the last leaf it needs; evicting 0 pages is always safe. Afterwards a parent left
  with one child is merged into that child, and an empty root is pruned.
- With `page_size > 1`, nodes, matches and splits are whole pages.

`evictable_pages` is kept incrementally (cached minus locked), never by walking the tree. Every
page range the tree gains or loses is published as block hashes when a publisher is attached.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping, Sequence

from cache.errors import CacheError, LengthMismatch, LockUnderflow
from cache.events import KvEventKind, KvEventPublisher, KvSnapshot
from cache.identity import BlockHasher
from cache.lru_heap import LruHeap
from cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from cache.page_pool import PageIds, PagePool
from cache.radix_node import InsertResult, MatchResult, Node
from cache.tokens import CacheKey, Keys, as_keys


def as_pages(pages: Sequence[int]) -> PageIds:
    """`pages` as an `array("i")` (as given when it is one already)."""
    if type(pages) is array and pages.typecode == "i":
        return pages
    return array("i", pages)


def common_prefix(node_keys: Keys, keys: Keys, at: int) -> int:
    """Length of the common prefix of `node_keys` and `keys[at:]`, by slice comparisons (each
    a memcmp of the two arrays' bytes)."""
    hi = min(len(node_keys), len(keys) - at)
    if keys[at : at + hi] == node_keys[:hi]:
        return hi
    lo = 0  # invariant: the first `lo` keys agree, the first `hi` do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if keys[at + lo : at + mid] == node_keys[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixCache:
    def __init__(
        self,
        pool: PagePool,
        hasher: BlockHasher | None = None,
        publisher: KvEventPublisher | None = None,
    ) -> None:
        if hasher is not None and hasher.block_size % pool.page_size:
            raise ValueError(
                f"block_size {hasher.block_size} must be a multiple of page_size "
                f"{pool.page_size}: a block ending inside a page would belong to every sibling "
                "that shares that page's start"
            )
        self.pool = pool
        self.page_size = pool.page_size
        self.hasher = hasher
        self.publisher = publisher
        self._trees: dict[CacheNamespace, Node] = {}
        self._heap = LruHeap()
        self._clock = 0
        self.cached_pages = 0
        self.locked_pages = 0
        self.node_count = 0
        self.evicted_pages = 0
        """Pages evicted since creation (a counter for metrics)."""

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def total_cached_pages(self) -> int:
        return self.cached_pages

    @property
    def evictable_pages(self) -> int:
        """Pages that eviction could free: every unlocked node's (O(1))."""
        return self.cached_pages - self.locked_pages

    @property
    def roots(self) -> Mapping[CacheNamespace, Node]:
        return self._trees

    def _key(self, keys: Keys, at: int) -> object:
        """The child-dict key of the node starting at `keys[at]`: its first page of keys (the
        key itself at page size 1, else the page's bytes)."""
        return keys[at] if self.page_size == 1 else keys[at : at + self.page_size].tobytes()

    # -- match ---------------------------------------------------------------------------------
    def match(
        self, keys: Sequence[CacheKey], namespace: CacheNamespace = DEFAULT_NAMESPACE
    ) -> MatchResult:
        """The longest cached prefix of `keys` in `namespace` (see the module contract)."""
        root = self._trees.get(namespace)
        if root is None:
            return MatchResult()
        node, length, pages, blocks = self._descend(root, as_keys(keys))
        if node is root:
            return MatchResult()
        self._touch(node)
        return MatchResult(pages, length, node, blocks)

    def _descend(self, node: Node, keys: Keys) -> tuple[Node, int, PageIds, list[int]]:
        """Walk down from `node` along `keys` as far as the tree holds them.

        The node where the walk stops inside a label is split there, so the walk always ends on
        a node. Returns that node, its end, and the pages and block hashes of the nodes passed.
        """
        ps, n, pos = self.page_size, len(keys), node.end
        pages = array("i")
        blocks: list[int] = []
        while pos + ps <= n:
            child = node.children.get(keys[pos] if ps == 1 else keys[pos : pos + ps].tobytes())
            if child is None:
                break
            length = len(child.keys)
            if keys[pos : pos + length] != child.keys:
                cut = common_prefix(child.keys, keys, pos)
                cut -= cut % ps  # > 0: the child's first page matched
                node = self._split(child, cut)
                pages.extend(node.pages)
                blocks.extend(node.blocks)
                pos += cut
                break
            pages.extend(child.pages)
            blocks.extend(child.blocks)
            pos += length
            node = child
        return node, pos, pages, blocks

    def _split(self, node: Node, cut: int) -> Node:
        """Split `node` after `cut` positions; returns the new parent holding the head."""
        ps = self.page_size
        nb = self._block_count(node.start, node.start + cut) if self.hasher else 0
        parent = node.parent
        assert parent is not None and 0 < cut < len(node.keys) and cut % ps == 0
        head = Node(parent, node.keys[:cut], node.pages[: cut // ps], node.start, node.blocks[:nb])
        head.lock_ref = node.lock_ref
        head.last_access = node.last_access
        node.keys = node.keys[cut:]
        node.pages = node.pages[cut // ps :]
        node.start += cut
        node.blocks = node.blocks[nb:]
        node.parent = head
        parent.children[self._key(head.keys, 0)] = head
        head.children[self._key(node.keys, 0)] = node
        self.node_count += 1
        return head

    def _block_count(self, start: int, end: int) -> int:
        """Routing blocks whose last position lies in [start, end)."""
        assert self.hasher is not None
        size = self.hasher.block_size
        return end // size - start // size

    def _touch(self, node: Node) -> None:
        """Mark `node` and its ancestors as used now; requeue `node` if it is evictable."""
        self._clock += 1
        now, current = self._clock, node
        while current.parent is not None:
            current.last_access = now
            current = current.parent
        if node.parent is not None and not node.children and node.lock_ref == 0:
            self._heap.push(node)
            if len(self._heap) > 4 * self.node_count + 1024:
                self._heap.rebuild(self._evictable_leaves())

    # -- insert --------------------------------------------------------------------------------
    def insert(
        self,
        keys: Sequence[CacheKey],
        pages: Sequence[int],
        namespace: CacheNamespace = DEFAULT_NAMESPACE,
        from_node: Node | None = None,
        block_hashes: list[int] | None = None,
    ) -> InsertResult:
        """Cache `keys`, whose KV is in `pages` (one page per `page_size` keys).

        `from_node` (a node ending on a prefix of `keys`, usually a match's `last_node`) skips
        the walk down to it. `block_hashes`, the chained hashes of `keys` so far, is extended in
        place and saves rehashing the prefix.
        """
        keys = as_keys(keys)
        ps, n = self.page_size, len(keys)
        if n == 0:
            raise LengthMismatch("nothing to insert: keys is empty")
        if n % ps or len(pages) * ps != n:
            raise LengthMismatch(
                f"{len(pages)} pages of {ps} positions cannot hold {n} keys "
                "(insert whole pages: one page per page_size keys)"
            )
        node, pos, existing, _ = self._descend(self._start_node(keys, namespace, from_node), keys)
        inserted = 0
        if pos < n:
            node = self._add_leaf(node, keys, as_pages(pages[pos // ps :]), namespace, block_hashes)
            inserted = len(node.pages)
        self._touch(node)
        return InsertResult(node, inserted, existing)

    def _start_node(self, keys: Keys, namespace: CacheNamespace, from_node: Node | None) -> Node:
        if from_node is None:
            root = self._trees.get(namespace)
            if root is None:
                root = Node(None, array("Q"), array("i"), 0, namespace=namespace)
                self._trees[namespace] = root
            return root
        top = from_node
        while top.parent is not None:
            top = top.parent
        if top.namespace != namespace or self._trees.get(namespace) is not top:
            raise ValueError("from_node is not a node of this cache's tree for the namespace")
        if keys[from_node.start : from_node.end] != from_node.keys:
            raise ValueError(
                f"from_node covers positions [{from_node.start}, {from_node.end}) whose keys "
                "differ from the keys being inserted"
            )
        return from_node

    def _add_leaf(
        self,
        parent: Node,
        keys: Keys,
        pages: PageIds,
        namespace: CacheNamespace,
        block_hashes: list[int] | None,
    ) -> Node:
        start = parent.end
        self.pool.claim(pages)  # raises, changing nothing, unless every page is private
        blocks: tuple[int, ...] = ()
        if self.hasher is not None:
            chain = self.hasher.extend(
                block_hashes if block_hashes is not None else [], keys, namespace, len(keys)
            )
            size = self.hasher.block_size
            blocks = tuple(chain[start // size : len(keys) // size])
        leaf = Node(parent, keys[start:], pages, start, blocks)
        parent.children[self._key(keys, start)] = leaf
        self.cached_pages += len(pages)
        self.node_count += 1
        if self.publisher is not None:
            self.publisher.publish(KvEventKind.STORED, blocks)
        return leaf

    # -- locks ---------------------------------------------------------------------------------
    def lock(self, node: Node | None) -> None:
        """Protect `node` and its ancestors from eviction (None: no-op)."""
        if node is None:
            return
        if node.parent is None and not node.is_root():
            raise ValueError(f"cannot lock {node!r}: it is no longer in the tree")
        current: Node | None = node
        while current is not None:
            if current.lock_ref == 0:
                self.locked_pages += len(current.pages)
            current.lock_ref += 1
            current = current.parent

    def unlock(self, node: Node | None) -> None:
        """Release one lock on `node` (None: no-op); raises `LockUnderflow` if it holds none."""
        if node is None:
            return
        if node.lock_ref <= 0:
            raise LockUnderflow(f"unlock of {node!r}, which holds no lock")
        current: Node | None = node
        while current is not None:
            current.lock_ref -= 1
            if current.lock_ref == 0:
                self.locked_pages -= len(current.pages)
            current = current.parent
        if node.lock_ref == 0 and not node.children:
            self._heap.push(node)

    # -- eviction ------------------------------------------------------------------------------
    def evict(self, needed_pages: int) -> int:
        """Free at least `needed_pages` pages if unlocked ones allow; returns the pages freed."""
        freed, removed = 0, list[int]()
        while freed < needed_pages:
            victim = self._pop_victim()
            if victim is None:
                break
            surplus = len(victim.pages) - (needed_pages - freed)
            if surplus > 0:  # keep the head, evict only the pages still needed
                self._split(victim, surplus * self.page_size)
            freed += self._remove_leaf(victim, removed)
        if removed and self.publisher is not None:
            self.publisher.publish(KvEventKind.REMOVED, removed)
        self.evicted_pages += freed
        return freed

    def _pop_victim(self) -> Node | None:
        while True:
            node = self._heap.pop()
            if node is None:
                return None
            parent = node.parent
            if (
                not node.children
                and node.lock_ref == 0
                and parent is not None
                and parent.children.get(self._key(node.keys, 0)) is node
            ):
                return node

    def _remove_leaf(self, leaf: Node, removed: list[int]) -> int:
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        del parent.children[self._key(leaf.keys, 0)]
        leaf.parent = None
        self.pool.uncache(leaf.pages)
        self.cached_pages -= len(leaf.pages)
        self.node_count -= 1
        removed.extend(leaf.blocks)
        if parent.is_root():
            if not parent.children:
                assert parent.lock_ref == 0, "an empty root holds a lock"
                del self._trees[parent.namespace]  # type: ignore[arg-type]
        elif not parent.children:
            if parent.lock_ref == 0:
                self._heap.push(parent)
        elif len(parent.children) == 1:
            self._coalesce(parent)
        return len(leaf.pages)

    def _coalesce(self, parent: Node) -> None:
        """Merge `parent` into its only child unless someone holds a lock on `parent` itself."""
        (child,) = parent.children.values()
        grand = parent.parent
        if grand is None or parent.lock_ref != child.lock_ref:
            return
        child.keys = parent.keys + child.keys
        child.pages = parent.pages + child.pages
        child.blocks = parent.blocks + child.blocks
        child.start = parent.start
        child.last_access = max(parent.last_access, child.last_access)
        child.parent = grand
        grand.children[self._key(child.keys, 0)] = child
        parent.parent = None
        parent.children = {}
        self.node_count -= 1
        if not child.children and child.lock_ref == 0:
            self._heap.push(child)

    def clear(self) -> int:
        """Drop every cached page (only when nothing is locked); publishes `cleared`."""
        locks = sum(root.lock_ref for root in self._trees.values())
        if locks:
            raise CacheError(f"cannot clear the cache while {locks} locks are held")
        freed = self.cached_pages
        for node in self.nodes():
            self.pool.uncache(node.pages)
        self._trees.clear()
        self._heap = LruHeap()
        self.cached_pages = self.locked_pages = self.node_count = 0
        if self.publisher is not None:
            self.publisher.publish(KvEventKind.CLEARED)
        return freed

    # -- views ---------------------------------------------------------------------------------
    def nodes(self) -> Iterator[Node]:
        """Every non-root node of every namespace (depth first)."""
        stack = list(self._trees.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.is_root():
                yield node

    def _evictable_leaves(self) -> list[Node]:
        return [n for n in self.nodes() if not n.children and n.lock_ref == 0]

    def heap_nodes(self) -> list[Node]:
        return self._heap.current()

    def block_set(self) -> set[int]:
        """Every routing block the tree holds, from the nodes themselves."""
        blocks: set[int] = set()
        for node in self.nodes():
            blocks.update(node.blocks)
        return blocks

    def snapshot(self) -> KvSnapshot:
        source = self.publisher.source if self.publisher else ""
        seq = self.publisher.seq if self.publisher else 0
        return KvSnapshot(source, seq, frozenset(self.block_set()))
