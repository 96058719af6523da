"""Small builders shared by the cache tests."""

from __future__ import annotations

from dataclasses import dataclass

from cache import BlockHasher, IdentityScheme, KvEventPublisher, PagePool, PageTable, RadixCache
from cache.integrity import check_tree

BOS = 1


@dataclass
class Stack:
    """A pool, a tree over it and a page table evicting from the tree (seed 000's trio)."""

    pool: PagePool
    tree: RadixCache
    table: PageTable
    events: KvEventPublisher

    @property
    def usable(self) -> int:
        return self.pool.usable_pages

    def check(self) -> None:
        self.pool.check()
        check_tree(self.tree)


def make_stack(
    num_pages: int = 100, page_size: int = 1, max_slots: int = 10, block_size: int | None = None
) -> Stack:
    block_size = block_size or max(4, page_size)
    pool = PagePool(num_pages, page_size)
    events = KvEventPublisher("test")
    tree = RadixCache(pool, BlockHasher(IdentityScheme(block_size, "test-model")), events)
    table = PageTable(pool, max_slots, evictor=tree)
    return Stack(pool, tree, table, events)
