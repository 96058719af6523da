"""Cluster membership: worker ids <-> small integer bits, so a set of workers is one int mask.

Bits are reused after a worker leaves (lowest free bit first), so masks stay as narrow as the
cluster. Must never hand out a bit that a live worker holds, nor keep one for a removed worker.
"""

from __future__ import annotations

import heapq

from router.errors import DuplicateWorker, UnknownWorker
from router.interface import WorkerId
from router.rendezvous import worker_seed


class Members:
    def __init__(self) -> None:
        self.bit: dict[WorkerId, int] = {}
        self.seed: dict[WorkerId, int] = {}
        self.order: list[WorkerId] = []
        """Workers in the order they joined (round robin walks this)."""
        self.by_bit: list[WorkerId | None] = []
        self.all_mask = 0
        self._free_bits: list[int] = []

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, worker: object) -> bool:
        return worker in self.bit

    def add(self, worker: WorkerId) -> int:
        if worker in self.bit:
            raise DuplicateWorker(worker)
        if self._free_bits:
            bit = heapq.heappop(self._free_bits)
            self.by_bit[bit] = worker
        else:
            bit = len(self.by_bit)
            self.by_bit.append(worker)
        self.bit[worker] = bit
        self.seed[worker] = worker_seed(worker)
        self.order.append(worker)
        self.all_mask |= 1 << bit
        return bit

    def remove(self, worker: WorkerId) -> int:
        bit = self.require(worker)
        del self.bit[worker], self.seed[worker]
        self.order.remove(worker)
        self.by_bit[bit] = None
        self.all_mask &= ~(1 << bit)
        heapq.heappush(self._free_bits, bit)
        return bit

    def require(self, worker: WorkerId) -> int:
        """The worker's bit; raises `UnknownWorker` if it is not a member."""
        bit = self.bit.get(worker)
        if bit is None:
            raise UnknownWorker(worker, len(self.order))
        return bit

    def workers_in(self, mask: int) -> list[WorkerId]:
        """The members whose bits are set in `mask`, by bit order."""
        out = []
        by_bit = self.by_bit
        while mask:
            low = mask & -mask
            worker = by_bit[low.bit_length() - 1]
            if worker is not None:
                out.append(worker)
            mask ^= low
        return out
