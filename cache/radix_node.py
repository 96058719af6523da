"""A node of the radix tree and the results that match and insert hand back.

A node is one edge label: the position keys `keys` (an `array("Q")`, a whole number of pages),
the `pages` (an `array("i")`) that hold their KV, and the routing `blocks` whose last position
falls inside the node. `start` is the position at which the node begins, so `start + len(keys)`
is where it ends. `tier` says which pool `pages` belong to (cache/tiers.py). A root has no keys
and carries its namespace; a node taken out of the tree has `parent = None` and must not be used.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from cache.namespace import CacheNamespace
from cache.page_pool import PageIds
from cache.tiers import DEVICE
from cache.tokens import Keys


class Node:
    __slots__ = (
        "blocks",
        "children",
        "heap_version",
        "keys",
        "last_access",
        "lock_ref",
        "namespace",
        "pages",
        "parent",
        "start",
        "tier",
    )

    def __init__(
        self,
        parent: Node | None,
        keys: Keys,
        pages: PageIds,
        start: int,
        blocks: tuple[int, ...] = (),
        namespace: CacheNamespace | None = None,
        tier: int = DEVICE,
    ) -> None:
        self.parent = parent
        self.keys = keys
        self.pages = pages
        self.start = start
        self.blocks = blocks
        self.namespace = namespace
        self.tier = tier
        self.children: dict[object, Node] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.heap_version = 0

    @property
    def end(self) -> int:
        """The position just after this node's last key."""
        return self.start + len(self.keys)

    def is_leaf(self) -> bool:
        return not self.children

    def is_root(self) -> bool:
        return self.namespace is not None

    def __repr__(self) -> str:
        return (
            f"Node([{self.start}, {self.end}), pages={len(self.pages)}, "
            f"children={len(self.children)}, lock_ref={self.lock_ref}, tier={self.tier})"
        )


@dataclass(slots=True)
class MatchResult:
    """The longest cached prefix of a key sequence.

    `pages` hold the KV of positions [0, length). They stay valid only while `last_node` is
    locked: lock it before anything can evict (any allocation can).
    """

    pages: PageIds = field(default_factory=lambda: array("i"))
    length: int = 0
    """Matched positions: a whole number of pages."""
    last_node: Node | None = None
    """The node that ends exactly at `length`; None when nothing matched."""
    block_hashes: list[int] = field(default_factory=list)
    """The chained hashes of the routing blocks inside [0, length), read off the nodes."""
    host_length: int = 0
    """Positions [length, length + host_length) are cached too, but in the host tier: promote
    them (`RadixCache.promote`) before use."""
    host_node: Node | None = None
    """The host node that ends at `length + host_length`; None when `host_length` is 0."""


@dataclass(slots=True)
class InsertResult:
    """What an insert found and claimed.

    Positions [from, node.end) of the inserted sequence now live in the tree, where `from` is
    the end of the `from_node` given to insert (0 without one). The first `len(existing_pages)`
    pages of that range were already cached: the caller's pages there are duplicates, to be
    swapped for `existing_pages` and freed. The next `inserted_pages` pages are the caller's own,
    now owned by the cache. Anything after `node.end` was not inserted and stays private.
    """

    node: Node
    inserted_pages: int
    existing_pages: PageIds
