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
  the tail of the last leaf it needs (a spilling tree, below, takes that leaf whole); evicting
  0 pages is always safe. Afterwards a parent left
  with one child is merged into that child, and an empty root is pruned.
- With `page_size > 1`, nodes, matches and splits are whole pages.
- `drop_namespaces` removes whole trees (an unloaded adapter's, on both tiers) at once; it
  refuses, changing nothing, while any of them holds a lock.
- With a host pool (cache/tiers.py), eviction demotes a device node to the host instead of
  dropping it, and drops host nodes (least recently used first) to make room there; a node too
  big for the host is dropped with everything below it. `match` reports the host-resident part
  of a match separately; `promote` brings it back to the device. `insert` of positions the tree
  holds on the host takes the caller's device pages for them and frees the host copy.
- With `on_drop` set, eviction calls it for each node it is about to take out of the tree
  (still attached, its pages still its own). It returns the nodes whose KV the caller wants (the
  dropped one, and any of its ancestors), each with a token; a `SpillCopy` of each one's pages
  is queued in order with the tier copies, so the caller reads the KV (for a disk tier) before
  the pages are reused or moved. `clear` and `drop_namespaces` call nothing.

`evictable_pages` is kept incrementally (device pages cached minus locked), never by walking the
tree. Every page range the tree gains or loses is published as block hashes when a publisher is
attached; a block keeps its place while its node moves between tiers.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Final

import numpy as np

from cache.errors import CacheError, LengthMismatch, LockUnderflow
from cache.events import KvEventKind, KvEventPublisher, KvSnapshot
from cache.identity import BlockHasher
from cache.lru_heap import LruHeap
from cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from cache.page_pool import PRIVATE, PageIds, PagePool
from cache.radix_node import InsertResult, MatchResult, Node
from cache.tiers import DEVICE, HOST, QueuedCopy, SpillCopy, TierCopy
from cache.tokens import CacheKey, Keys, as_keys


def as_pages(pages: Sequence[int]) -> PageIds:
    """`pages` as an `array("i")` (as given when it is one already)."""
    if type(pages) is array and pages.typecode == "i":
        return pages
    return array("i", pages)


def _no_device_child(node: Node) -> bool:
    """Whether no child of `node` is on the device (a device node eviction may demote)."""
    children = node.children
    return not children or all(child.tier != DEVICE for child in children.values())


_NUMPY_PREFIX_FROM: Final = 256
"""Keys from which one numpy comparison finds the first difference faster than bisecting."""


def common_prefix(node_keys: Keys, keys: Keys, at: int) -> int:
    """Length of the common prefix of `node_keys` and `keys[at:]`: by slice comparisons (each
    a memcmp of the two arrays' bytes), bisecting; from `_NUMPY_PREFIX_FROM` keys, by one
    elementwise comparison in numpy (3 us against 8 for 4,096 keys)."""
    hi = min(len(node_keys), len(keys) - at)
    if keys[at : at + hi] == node_keys[:hi]:
        return hi
    if hi >= _NUMPY_PREFIX_FROM:
        ours = np.frombuffer(node_keys, dtype=np.uint64, count=hi)
        theirs = np.frombuffer(keys, dtype=np.uint64, count=hi, offset=at * ours.itemsize)
        return int((ours != theirs).argmax())  # some key differs: the slices were unequal
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
        host_pool: PagePool | None = None,
        on_drop: Callable[[Node], Iterable[tuple[Node, object]]] | None = None,
    ) -> None:
        if host_pool is not None and host_pool.page_size != pool.page_size:
            raise ValueError(
                f"the host pool's page_size {host_pool.page_size} differs from the device "
                f"pool's {pool.page_size}: a node's pages move between them one for one"
            )
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
        """Device pages evicted (demoted or dropped) since creation (a counter for metrics)."""
        self.host_pool = host_pool
        self._host_heap = LruHeap()
        self.demoted_pages = 0
        """Pages copied from the device to the host on eviction."""
        self.promoted_pages = 0
        """Pages copied from the host back to the device for a match."""
        self.adopted_pages = 0
        """Host pages replaced by an insert's freshly computed device pages."""
        self.host_evicted_pages = 0
        """Host pages dropped to make room."""
        self.on_drop = on_drop
        """Called with each node eviction takes out of the tree; returns (node, token) pairs,
        each queueing a `SpillCopy` of that node's pages (cache/tiers.py)."""
        self.spilled_pages = 0
        """Pages handed to `on_drop`'s caller by a `SpillCopy`."""
        self._copies: list[QueuedCopy] = []

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def total_cached_pages(self) -> int:
        return self.cached_pages

    @property
    def host_cached_pages(self) -> int:
        """Pages of the host tier holding cached KV (the host pool's own count)."""
        return self.host_pool.num_cached if self.host_pool is not None else 0

    @property
    def evictable_pages(self) -> int:
        """Pages that eviction could free: every unlocked node's (O(1))."""
        return self.cached_pages - self.locked_pages

    def _publish(self, kind: KvEventKind, blocks: list[int]) -> None:
        """Publish `blocks` (and empty the list) when there are any and a publisher."""
        if blocks and self.publisher is not None:
            self.publisher.publish(kind, blocks)
        blocks.clear()

    def take_copies(self) -> list[QueuedCopy]:
        """The tier copies queued since the last call, in the order they must run."""
        copies, self._copies = self._copies, []
        return copies

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
        if node.tier == DEVICE:
            return MatchResult(pages, length, node, blocks)
        device: Node | None = node
        while device is not None and device.tier != DEVICE:
            device = device.parent
        on_device = len(pages) * self.page_size
        last = None if device is None or device.is_root() else device
        return MatchResult(pages, on_device, last, blocks, length - on_device, node)

    def promote(self, match: MatchResult, spare: int = 0) -> MatchResult:
        """`match` with its host-resident part moved back to the device (a `TierCopy` each),
        or `match` unchanged when the device cannot make room for it, and then for `spare` more
        pages, without evicting the match itself."""
        top = match.host_node
        if top is None:
            return match
        need = sum(len(n.pages) for n in self._host_path(top))
        self.lock(top)  # the whole path, on both tiers: nothing below can be evicted meanwhile
        try:
            short = need - self.pool.num_free
            if short + spare > self.evictable_pages:
                return match
            if short > 0:
                self.evict(short)
            # eviction may have merged nodes of the path (a parent left with its one locked
            # child): the same pages, in fewer nodes
            path = self._host_path(top)
            fresh = self.pool.allocate(need)
            pages, blocks, at = array("i", match.pages), list(match.block_hashes), 0
            for node in path:
                count = len(node.pages)
                self._move_to_device(node, fresh[at : at + count], True)
                at += count
                pages.extend(node.pages)
                blocks.extend(node.blocks)
            self.promoted_pages += need
            self._publish(KvEventKind.PROMOTED, blocks[len(match.block_hashes) :])
        finally:
            self.unlock(top)
        return MatchResult(pages, top.end, top, blocks)

    @staticmethod
    def _host_path(top: Node) -> list[Node]:
        """The host nodes from the first one above `top` down to `top`, top-down."""
        path = []
        node: Node | None = top
        while node is not None and node.tier == HOST:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def _move_to_device(self, node: Node, pages: PageIds, copy: bool) -> None:
        """Give host node `node` the private device `pages` instead of its host pages (`copy`:
        queue the copy of its KV into them)."""
        assert self.host_pool is not None and node.tier == HOST
        self.pool.claim(pages)
        if copy:
            self._copies.append(TierCopy(HOST, node.pages, DEVICE, pages))
        self.host_pool.uncache(node.pages)
        count = len(pages)
        node.pages, node.tier = pages, DEVICE
        self.cached_pages += count
        if node.lock_ref:
            self.locked_pages += count

    def _descend(
        self, node: Node, keys: Keys, stop_at_host: bool = False
    ) -> tuple[Node, int, PageIds, list[int]]:
        """Walk down from `node` along `keys` as far as the tree holds them (`stop_at_host`:
        only through device nodes).

        The node where the walk stops inside a label is split there, so the walk always ends on
        a node. Returns that node, its end, and the device pages and their block hashes of the
        nodes passed (host nodes come last on any path: their pages are left out).
        """
        ps, n, pos = self.page_size, len(keys), node.end
        pages = array("i")
        blocks: list[int] = []
        while pos + ps <= n:
            child = node.children.get(keys[pos] if ps == 1 else keys[pos : pos + ps].tobytes())
            if child is None or (stop_at_host and child.tier != DEVICE):
                break
            length = len(child.keys)
            if keys[pos : pos + length] != child.keys:
                cut = common_prefix(child.keys, keys, pos)
                cut -= cut % ps  # > 0: the child's first page matched
                node = self._split(child, cut)
                if node.tier == DEVICE:
                    pages.extend(node.pages)
                    blocks.extend(node.blocks)
                pos += cut
                break
            if child.tier == DEVICE:
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
        head = Node(
            parent,
            node.keys[:cut],
            node.pages[: cut // ps],
            node.start,
            node.blocks[:nb],
            tier=node.tier,
        )
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
        self._requeue(node)
        if node.tier == HOST:  # the device node above it was used as well
            above = node.parent
            while above is not None and above.tier == HOST:
                above = above.parent
            if above is not None:
                self._requeue(above)

    def _requeue(self, node: Node) -> None:
        """Give `node` a current entry in its tier's heap if eviction may take it now: a device
        node with no child on the device, or a host leaf; unlocked either way."""
        if node.parent is None or node.lock_ref:
            return
        if node.tier == DEVICE:
            if not _no_device_child(node):
                return
            self._heap.push(node)
            if len(self._heap) > 4 * self.node_count + 1024:
                self._heap.rebuild(self._evictable_leaves())
        elif not node.children:
            self._host_heap.push(node)
            if len(self._host_heap) > 4 * self.node_count + 1024:
                self._host_heap.rebuild(n for n in self.nodes() if self._host_victim(n))

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
        start = self._start_node(keys, namespace, from_node)
        node, pos, existing, _ = self._descend(start, keys, self.host_pool is not None)
        inserted = 0
        if pos < n and self.host_cached_pages:
            node, pos, inserted = self._adopt_host(node, keys, pages, pos)
        if pos < n:
            node = self._add_leaf(node, keys, as_pages(pages[pos // ps :]), namespace, block_hashes)
            inserted += len(node.pages)
        self._touch(node)
        return InsertResult(node, inserted, existing)

    def _adopt_host(
        self, node: Node, keys: Keys, pages: Sequence[int], pos: int
    ) -> tuple[Node, int, int]:
        """Below `node`, host nodes holding `keys[pos:]` take the caller's device pages for
        those positions (already computed: nothing is copied) and free their host pages.
        Returns the last node taken, where it ends, and the pages taken."""
        ps, n, adopted, moved = self.page_size, len(keys), 0, list[int]()
        while pos < n:
            child = node.children.get(self._key(keys, pos))
            if child is None:
                break
            assert child.tier == HOST, "a device node below where the walk left the device"
            cut = common_prefix(child.keys, keys, pos)
            cut -= cut % ps
            if cut < len(child.keys):
                child = self._split(child, cut)
            if not adopted:  # all or nothing: check every page the caller gives up front
                self.pool.require(as_pages(pages[pos // ps :]), PRIVATE)
            self._move_to_device(child, as_pages(pages[pos // ps : (pos + cut) // ps]), False)
            self.adopted_pages += cut // ps
            adopted += cut // ps
            moved.extend(child.blocks)
            pos += cut
            node = child
        self._publish(KvEventKind.PROMOTED, moved)
        return node, pos, adopted

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
            if current.lock_ref == 0 and current.tier == DEVICE:
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
            if current.lock_ref == 0 and current.tier == DEVICE:
                self.locked_pages -= len(current.pages)
            current = current.parent
        if node.lock_ref == 0:
            self._requeue(node)

    # -- eviction ------------------------------------------------------------------------------
    def evict(self, needed_pages: int) -> int:
        """Free at least `needed_pages` device pages if unlocked ones allow (demoting them to
        the host when there is one); returns the device pages freed."""
        freed = 0
        removed: list[int] = []  # not list[int](): that builds a generic alias each call
        dropped: list[PageIds] = []
        while freed < needed_pages:
            victim = self._pop_victim()
            if victim is None:
                break
            surplus = len(victim.pages) - (needed_pages - freed)
            if surplus > 0 and self.on_drop is None:  # keep the head, evict only what is needed
                # (a spilling tree moves or drops the whole leaf: `_spill` says why)
                if self.host_pool is None:  # a leaf: cut in place, no node for the tail
                    freed += self._trim(victim, surplus, removed, dropped)
                    continue
                self._split(victim, surplus * self.page_size)
            freed += self._demote(victim, removed) or self._drop_subtree(victim, removed, dropped)
        self._free_dropped(dropped)
        self._publish(KvEventKind.REMOVED, removed)
        self.evicted_pages += freed
        return freed

    def _free_dropped(self, dropped: list[PageIds]) -> None:
        """Return the device pages of the nodes an eviction dropped to the pool in one checked
        move (the pool's cost is per call), the last node's on top of the free stack as moves
        node by node would leave them (demoted nodes' pages, freed as they go, end up below)."""
        if len(dropped) == 1:
            self.pool.uncache(dropped[0])
        elif dropped:
            pages = array("i")
            for chunk in reversed(dropped):
                pages.extend(chunk)
            self.pool.uncache(pages)

    def _trim(self, leaf: Node, keep: int, removed: list[int], dropped: list[PageIds]) -> int:
        """Cut device leaf `leaf` down to its first `keep` pages in place (what splitting it
        and removing the tail would leave, without the extra node); the tail's pages are
        appended to `dropped` for the caller to free. Returns the pages cut."""
        assert not leaf.children and leaf.lock_ref == 0 and 0 < keep < len(leaf.pages)
        cut = keep * self.page_size
        tail = leaf.pages[keep:]
        nb = self._block_count(leaf.start, leaf.start + cut) if self.hasher else 0
        removed.extend(leaf.blocks[nb:])
        leaf.keys, leaf.pages, leaf.blocks = leaf.keys[:cut], leaf.pages[:keep], leaf.blocks[:nb]
        dropped.append(tail)
        self.cached_pages -= len(tail)
        self._requeue(leaf)
        return len(tail)

    def _pop_victim(self) -> Node | None:
        """The least recently used device node with no child on the device, unlocked."""
        while True:
            node = self._heap.pop()
            if node is None:
                return None
            parent = node.parent
            if (
                node.tier == DEVICE
                and node.lock_ref == 0
                and parent is not None
                and parent.children.get(self._key(node.keys, 0)) is node
                and _no_device_child(node)
            ):
                return node

    def _host_victim(self, node: Node) -> bool:
        parent = node.parent
        return (
            node.tier == HOST
            and not node.children
            and node.lock_ref == 0
            and parent is not None
            and parent.children.get(self._key(node.keys, 0)) is node
        )

    def _demote(self, node: Node, removed: list[int]) -> int:
        """Move device node `node` to the host, dropping host leaves to make room; returns the
        device pages freed, 0 (and `node` still on the device) when the host cannot hold it."""
        host = self.host_pool
        if host is None:
            return 0
        while True:
            count = len(node.pages)  # grows if a drop below leaves its parent to merge into it
            if count > host.usable_pages:
                return 0
            if host.num_free >= count:
                break
            victim = self._host_heap.pop()
            if victim is None:
                return 0
            if not self._host_victim(victim):
                continue
            surplus = len(victim.pages) - (count - host.num_free)
            if surplus > 0 and self.on_drop is None:  # spilling: the whole leaf (`_spill`)
                self._split(victim, surplus * self.page_size)
            self.host_evicted_pages += len(victim.pages)
            assert victim.tier == HOST  # no device pages to collect
            self._remove_leaf(victim, removed, [])
        self._publish(KvEventKind.REMOVED, removed)  # the drops came first
        pages = host.allocate(count)
        host.claim(pages)
        self._copies.append(TierCopy(DEVICE, node.pages, HOST, pages))
        self.pool.uncache(node.pages)
        node.pages, node.tier = pages, HOST
        self.cached_pages -= count
        self.demoted_pages += count
        self._publish(KvEventKind.DEMOTED, list(node.blocks))
        self._requeue(node)
        if node.parent is not None:
            self._requeue(node.parent)
        return count

    def _drop_subtree(self, node: Node, removed: list[int], dropped: list[PageIds]) -> int:
        """Remove device node `node` and everything below it (all on the host: `node` has no
        device child); returns the device pages freed, which are appended to `dropped` for the
        caller to return to the pool."""
        if node.children:
            below = []
            stack = list(node.children.values())
            while stack:
                child = stack.pop()
                below.append(child)
                stack.extend(child.children.values())
            for child in reversed(below):  # children after their parents: leaves come first
                self.host_evicted_pages += len(child.pages)
                self._remove_leaf(child, removed, dropped, settle=False)
        return self._remove_leaf(node, removed, dropped)

    def _remove_leaf(
        self, leaf: Node, removed: list[int], dropped: list[PageIds], settle: bool = True
    ) -> int:
        """Take leaf `leaf` out of the tree, free its host pages or append its device pages to
        `dropped` (the caller frees those); `settle`: then requeue, merge or prune its parent as
        its new shape requires."""
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        if self.on_drop is not None:
            self._spill(leaf)
        del parent.children[self._key(leaf.keys, 0)]
        leaf.parent = None
        count = len(leaf.pages)
        if leaf.tier == DEVICE:
            dropped.append(leaf.pages)
            self.cached_pages -= count
        else:
            assert self.host_pool is not None
            self.host_pool.uncache(leaf.pages)
        self.node_count -= 1
        removed.extend(leaf.blocks)
        if not settle:
            return count
        if parent.is_root():
            if not parent.children:
                assert parent.lock_ref == 0, "an empty root holds a lock"
                del self._trees[parent.namespace]  # type: ignore[arg-type]
        elif len(parent.children) == 1:
            self._coalesce(parent)
        else:
            self._requeue(parent)
        return count

    def _spill(self, node: Node) -> None:
        """Offer `node` (about to leave the tree, still attached) to `on_drop`; queue a
        `SpillCopy` of the pages of each node it asks for.

        While spilling, eviction moves or drops a leaf whole (demoted, dropped from the host, or
        from a device without one), not split to free only the pages needed: the head a split
        keeps is a new node, so the next drop below it, a page at a time as decodes grow, would
        spill it again as an ancestor (64 pages evicted one by one spilled 2,079, with a host
        tier or without). What goes beyond the pages needed moves down a tier, or to disk."""
        assert self.on_drop is not None
        for kept, token in self.on_drop(node):
            self._copies.append(SpillCopy(kept.tier, kept.pages, token))
            self.spilled_pages += len(kept.pages)

    def _coalesce(self, parent: Node) -> None:
        """Merge `parent` into its only child unless someone holds a lock on `parent` itself or
        they live in different tiers."""
        (child,) = parent.children.values()
        grand = parent.parent
        if grand is None or parent.lock_ref != child.lock_ref or parent.tier != child.tier:
            self._requeue(parent)
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
        self._requeue(child)

    def clear(self) -> int:
        """Drop every cached page (only when nothing is locked); publishes `cleared`."""
        locks = sum(root.lock_ref for root in self._trees.values())
        if locks:
            raise CacheError(f"cannot clear the cache while {locks} locks are held")
        freed = self.cached_pages
        for node in self.nodes():
            if node.tier == DEVICE:
                self.pool.uncache(node.pages)
            else:
                assert self.host_pool is not None
                self.host_pool.uncache(node.pages)
        self._trees.clear()
        self._heap, self._host_heap = LruHeap(), LruHeap()
        self.cached_pages = self.locked_pages = self.node_count = 0
        if self.publisher is not None:
            self.publisher.publish(KvEventKind.CLEARED)
        return freed

    def drop_namespaces(
        self, which: Callable[[CacheNamespace], bool] | AbstractSet[CacheNamespace]
    ) -> int:
        """Drop every node of the namespaces `which` selects (a predicate or a set), on both
        tiers, publishing their blocks as `removed`; returns the device pages freed.

        Raises `CacheError`, changing nothing, while one of them holds a lock (a running
        sequence uses it). Other namespaces, their LRU order and their locks are untouched.
        """
        select = which.__contains__ if isinstance(which, AbstractSet) else which
        chosen = [ns for ns in self._trees if select(ns)]
        locked = {ns: self._trees[ns].lock_ref for ns in chosen if self._trees[ns].lock_ref}
        if locked:
            raise CacheError(f"cannot drop namespaces while they hold locks: {locked}")
        freed, removed = 0, list[int]()
        for namespace in chosen:
            root = self._trees.pop(namespace)
            stack = list(root.children.values())
            root.children = {}
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                count = len(node.pages)
                if node.tier == DEVICE:
                    self.pool.uncache(node.pages)
                    self.cached_pages -= count
                    freed += count
                else:
                    assert self.host_pool is not None
                    self.host_pool.uncache(node.pages)
                removed.extend(node.blocks)
                node.parent, node.children = None, {}  # its heap entries go stale: skipped
                self.node_count -= 1
        self._publish(KvEventKind.REMOVED, removed)
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
        """Device nodes that eviction may take now (no child on the device, unlocked)."""
        return [
            n for n in self.nodes() if n.tier == DEVICE and n.lock_ref == 0 and _no_device_child(n)
        ]

    def heap_nodes(self) -> list[Node]:
        return self._heap.current()

    def host_heap_nodes(self) -> list[Node]:
        return self._host_heap.current()

    def block_set(self) -> set[int]:
        """Every routing block the tree holds, from the nodes themselves."""
        blocks: set[int] = set()
        for node in self.nodes():
            blocks.update(node.blocks)
        return blocks

    def host_block_set(self) -> set[int]:
        """The routing blocks of nodes in the host tier."""
        blocks: set[int] = set()
        if self.host_cached_pages:
            for node in self.nodes():
                if node.tier == HOST:
                    blocks.update(node.blocks)
        return blocks

    def snapshot(self) -> KvSnapshot:
        source = self.publisher.source if self.publisher else ""
        seq = self.publisher.seq if self.publisher else 0
        blocks: set[int] = set()
        host: set[int] = set()
        for node in self.nodes():  # one walk for both sets
            (blocks if node.tier == DEVICE else host).update(node.blocks)
        return KvSnapshot(source, seq, frozenset(blocks | host), frozenset(host))
