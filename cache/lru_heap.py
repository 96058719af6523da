"""LRU order of evictable leaves: a min-heap with versioned lazy deletion.

Pushing a node bumps its `heap_version`; entries carrying an older version are stale and are
dropped when they surface. The heap is rebuilt from the live leaves when stale entries outnumber
live nodes, so repeated touches of a hot leaf cannot grow it without bound.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from cache.radix_node import Node


class LruHeap:
    def __init__(self) -> None:
        self._entries: list[tuple[int, int, int, Node]] = []
        self._counter = 0

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, node: Node) -> None:
        node.heap_version += 1
        self._counter += 1
        heapq.heappush(self._entries, (node.last_access, self._counter, node.heap_version, node))

    def pop(self) -> Node | None:
        """The least recently used node with a current entry, or None when none is left."""
        entries = self._entries
        while entries:
            _, _, version, node = heapq.heappop(entries)
            if version == node.heap_version:
                return node
        return None

    def rebuild(self, nodes: Iterable[Node]) -> None:
        self._entries = []
        for node in nodes:
            node.heap_version += 1
            self._counter += 1
            self._entries.append((node.last_access, self._counter, node.heap_version, node))
        heapq.heapify(self._entries)

    def current(self) -> list[Node]:
        """Nodes whose newest entry is in the heap (for integrity checks)."""
        return [node for _, _, version, node in self._entries if version == node.heap_version]
