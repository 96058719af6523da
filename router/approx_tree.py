"""SGLang router's approximate tree, over routing blocks instead of characters.

The tree remembers, per worker ("tenant"), the prompts the router sent there, not what the
worker really holds: it is a guess, by design (SGLang's router sees only request text). Because
a block's chained hash names its whole prefix, the tree is a dict from block hash to its node:
the workers that were sent it and when they last were. A prompt's match is its longest run of
leading blocks present for any worker; its tenant is the first worker (in the order they were
sent it) still recorded at the deepest matched block, and matching refreshes that worker's path.

Sizes are kept per worker in tokens; `evict(max_tokens)` drops each oversized worker's least
recently used leaves (blocks none of whose children it holds) until it fits, as SGLang's
periodic `evict_tenant_by_size` does. Used only by the `sglang` baseline policy; it must
never read KV events, or it would stop being the baseline it stands for.
"""

from __future__ import annotations

import heapq
import sys
from dataclasses import dataclass, field

from router.block_index import INT_BYTES
from router.interface import WorkerId


@dataclass(slots=True)
class _Node:
    parent: int | None
    tenants: dict[WorkerId, float] = field(default_factory=dict)
    """Worker -> when the router last sent (or matched) this block there."""
    children: dict[WorkerId, int] = field(default_factory=dict)
    """Worker -> how many child blocks it holds (a leaf for a worker when 0 / absent)."""


class ApproxTree:
    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.nodes: dict[int, _Node] = {}
        self.size: dict[WorkerId, int] = {}
        """Worker -> tokens the tree records for it."""

    def add_tenant(self, worker: WorkerId) -> None:
        self.size.setdefault(worker, 0)

    def match(self, hashes: tuple[int, ...], now: float) -> tuple[int, WorkerId | None]:
        """(leading blocks present for any worker, the tenant at the deepest one)."""
        nodes = self.nodes
        depth = 0
        for block in hashes:
            if block not in nodes:
                break
            depth += 1
        if depth == 0:
            return 0, None
        tenant = next(iter(nodes[hashes[depth - 1]].tenants), None)
        if tenant is not None:
            for block in hashes[:depth]:
                nodes[block].tenants[tenant] = now
        return depth, tenant

    def insert(self, hashes: tuple[int, ...], worker: WorkerId, now: float) -> None:
        nodes, parent = self.nodes, None
        added = 0
        for block in hashes:
            node = nodes.get(block)
            if node is None:
                node = nodes[block] = _Node(parent)
            if worker not in node.tenants:
                added += 1
                if parent is not None:
                    siblings = nodes[parent].children
                    siblings[worker] = siblings.get(worker, 0) + 1
            node.tenants[worker] = now
            parent = block
        self.size[worker] = self.size.get(worker, 0) + added * self.block_tokens

    def smallest_tenant(self, workers: list[WorkerId]) -> WorkerId:
        """The worker with the fewest recorded tokens (ties: the earliest in `workers`)."""
        size = self.size
        return min(workers, key=lambda w: size.get(w, 0))

    def remove_tenant(self, worker: WorkerId) -> None:
        for block in [b for b, node in self.nodes.items() if worker in node.tenants]:
            self._drop(block, worker)
        self.size.pop(worker, None)

    def evict(self, max_tokens: int) -> None:
        """Bring every worker down to `max_tokens`, least recently used leaves first."""
        over = {w for w, s in self.size.items() if s > max_tokens}
        if not over:
            return
        heap = [
            (stamp, worker, block)
            for block, node in self.nodes.items()
            for worker, stamp in node.tenants.items()
            if worker in over and not node.children.get(worker)
        ]
        heapq.heapify(heap)
        while heap:
            _, worker, block = heapq.heappop(heap)
            if self.size[worker] <= max_tokens:
                continue
            parent = self.nodes[block].parent
            self._drop(block, worker)
            if parent is not None and not self.nodes[parent].children.get(worker):
                heapq.heappush(heap, (self.nodes[parent].tenants[worker], worker, parent))

    def _drop(self, block: int, worker: WorkerId) -> None:
        node = self.nodes[block]
        if node.tenants.pop(worker, None) is None:
            return
        node.children.pop(worker, None)
        self.size[worker] -= self.block_tokens
        parent = self.nodes.get(node.parent) if node.parent is not None else None
        if parent is not None:
            siblings = parent.children
            left = siblings.get(worker, 0) - 1
            if left > 0:
                siblings[worker] = left
            else:
                siblings.pop(worker, None)
        if not node.tenants:
            del self.nodes[block]

    def nbytes(self) -> int:
        """Bytes held: the node dict, each node and its two small dicts, one int per block."""
        per_node = sum(
            sys.getsizeof(n) + sys.getsizeof(n.tenants) + sys.getsizeof(n.children)
            for n in self.nodes.values()
        )
        return sys.getsizeof(self.nodes) + per_node + INT_BYTES * len(self.nodes)
