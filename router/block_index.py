"""The exact block index: which routing blocks each worker holds, from its KV events.

Per worker a `cache.BlockSetIndex` applies `stored` / `removed` / `cleared` events in sequence
order and notices a gap; beside it, `holders` maps each block hash to the mask of workers that
hold it, so one walk down a request's chained hashes finds every worker's match length at once.
Removing a worker, or a `cleared` event, costs O(that worker's blocks), not O(the cluster).

Must never guess: a block is in a worker's set only if that worker's events (or snapshot) said
so. Stale-but-unconfirmed knowledge lives in `router/pending.py`, not here.

With host tiers, `host_holders` maps each block some worker holds in host memory to the mask
of those workers (`demoted` / `promoted` events, the snapshot's host blocks): a worker's blocks
on a request's chain are a device prefix then a host suffix, so `host_from` finds where its
host part begins. It stays empty, and costs nothing, while no worker has a host tier.

With saved caches, a worker also holds the blocks its files hold (`saved` / `unsaved` events,
the snapshot's disk blocks): `holders` counts a block on disk alone as held, and `disk_holders`
maps each such block (on a worker's disk, not in its cache) to the mask of those workers. Both
the cache's blocks and the saved ones are prefix-closed, so a worker's blocks on a chain are
its cache's (device, then host) and then those on its disk alone: `disk_from` finds where
that last part begins. Empty, and free, while no worker saves its cache.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from cache import BlockSetIndex, KvEvent, KvEventKind, KvSnapshot
from router.interface import WorkerId

INT_BYTES = sys.getsizeof(1 << 63)
"""A 64-bit block hash as a Python int object."""


def mark(holders: dict[int, int], bit: int, blocks: Iterable[int]) -> None:
    """Set `bit` in the holder mask of every block of `blocks`."""
    mask, get = 1 << bit, holders.get
    for block in blocks:
        holders[block] = get(block, 0) | mask


def unmark(holders: dict[int, int], bit: int, blocks: Iterable[int]) -> None:
    """Clear `bit` in the holder mask of every block of `blocks`; a block held by nobody left
    leaves `holders`."""
    keep = ~(1 << bit)
    for block in blocks:
        mask = holders.get(block, 0) & keep
        if mask:
            holders[block] = mask
        else:
            holders.pop(block, None)


class BlockIndex:
    def __init__(self) -> None:
        self.holders: dict[int, int] = {}
        """Block hash -> mask of the workers whose events say they hold it."""
        self.host_holders: dict[int, int] = {}
        """Block hash -> mask of the workers holding it in their host tier."""
        self.disk_holders: dict[int, int] = {}
        """Block hash -> mask of the workers holding it on disk and not in their cache."""
        self._sets: dict[WorkerId, BlockSetIndex] = {}
        self._bits: dict[WorkerId, int] = {}

    def add(self, worker: WorkerId, bit: int) -> None:
        self._sets[worker] = BlockSetIndex(worker)
        self._bits[worker] = bit

    def remove(self, worker: WorkerId) -> None:
        """Drop the worker's blocks: O(its size)."""
        bit, index = self._bits.pop(worker), self._sets.pop(worker)
        unmark(self.holders, bit, index.blocks | index.disk if index.disk else index.blocks)
        unmark(self.host_holders, bit, index.host)
        if index.disk:
            unmark(self.disk_holders, bit, index.disk - index.blocks)

    def apply(self, worker: WorkerId, event: KvEvent) -> bool:
        """Apply the worker's next event; False after a gap (until `load_snapshot`)."""
        index = self._sets[worker]
        before = index.seq
        kind = event.kind
        cleared = (set(index.blocks), set(index.host)) if kind is KvEventKind.CLEARED else None
        ok = index.apply(event)
        if index.seq == before:
            return ok  # a gap (ignored), or a redelivery already reflected
        bit, hashes, disk = self._bits[worker], event.block_hashes, index.disk
        if kind is KvEventKind.STORED:
            mark(self.holders, bit, hashes)
            if disk:
                unmark(self.disk_holders, bit, hashes)
        elif kind is KvEventKind.REMOVED:
            if disk:
                self._dropped(bit, hashes, disk)
            else:
                unmark(self.holders, bit, hashes)
            if self.host_holders:
                unmark(self.host_holders, bit, hashes)
        elif kind is KvEventKind.DEMOTED:
            mark(self.host_holders, bit, hashes)
        elif kind is KvEventKind.PROMOTED:
            unmark(self.host_holders, bit, hashes)
        elif kind is KvEventKind.SAVED:
            alone = [h for h in hashes if h not in index.blocks]
            mark(self.holders, bit, alone)
            mark(self.disk_holders, bit, alone)
        elif kind is KvEventKind.UNSAVED:
            alone = [h for h in hashes if h not in index.blocks]
            unmark(self.holders, bit, alone)
            unmark(self.disk_holders, bit, alone)
        else:
            assert cleared is not None
            self._dropped(bit, cleared[0], disk)
            unmark(self.host_holders, bit, cleared[1])
        return True

    def _dropped(self, bit: int, hashes: Iterable[int], disk: set[int]) -> None:
        """Blocks that left the worker's cache: held still where its disk has them."""
        if not disk:
            unmark(self.holders, bit, hashes)
            return
        on_disk = [h for h in hashes if h in disk]
        unmark(self.holders, bit, [h for h in hashes if h not in disk])
        mark(self.disk_holders, bit, on_disk)

    def load_snapshot(self, worker: WorkerId, snapshot: KvSnapshot) -> None:
        """Replace the worker's set by `snapshot` (after a gap, or on (re)join)."""
        index = self._sets[worker]
        old, old_host, old_alone = index.blocks | index.disk, index.host, index.disk - index.blocks
        index.load_snapshot(snapshot)
        bit = self._bits[worker]
        held, alone = index.blocks | index.disk, index.disk - index.blocks
        unmark(self.holders, bit, old - held)
        mark(self.holders, bit, held - old)
        unmark(self.host_holders, bit, old_host - index.host)
        mark(self.host_holders, bit, index.host - old_host)
        unmark(self.disk_holders, bit, old_alone - alone)
        mark(self.disk_holders, bit, alone - old_alone)

    def in_sync(self, worker: WorkerId) -> bool:
        return self._sets[worker].in_sync

    def blocks(self, worker: WorkerId) -> int:
        """How many blocks the worker holds, as its events say."""
        return len(self._sets[worker].blocks)

    def depth(self, bit: int, hashes: tuple[int, ...]) -> int:
        """How many leading blocks of `hashes` the worker of `bit` holds (its set is
        prefix-closed: gallop 1, 2, 4, ... then bisect, O(log depth) lookups)."""
        mask, get, n = 1 << bit, self.holders.get, len(hashes)
        if not n or not get(hashes[0], 0) & mask:
            return 0
        good, step = 0, 1  # hashes[good] is held
        while good + step < n and get(hashes[good + step], 0) & mask:
            good += step
            step *= 2
        bad = min(good + step, n)
        while bad - good > 1:
            mid = (good + bad) // 2
            if get(hashes[mid], 0) & mask:
                good = mid
            else:
                bad = mid
        return good + 1

    def host_from(self, bit: int, hashes: tuple[int, ...], depth: int) -> int:
        """Where the host part of the worker's first `depth` blocks of `hashes` begins (`depth`
        when none of them is on its host): a bisection, the host blocks being a suffix. With
        a disk, `depth` must end where its disk-only part begins (`disk_from`)."""
        return _suffix_from(self.host_holders, bit, hashes, depth)

    def disk_from(self, bit: int, hashes: tuple[int, ...], depth: int) -> int:
        """Where the part of the worker's first `depth` blocks of `hashes` that only its disk
        holds begins (`depth` when none)."""
        return _suffix_from(self.disk_holders, bit, hashes, depth)

    def nbytes(self) -> int:
        """Bytes held: every set's and the holders dict's tables, one int per distinct block,
        and one mask per block once masks outgrow CPython's cached small ints (bit 8 up)."""
        tables = sum(sys.getsizeof(index.blocks) for index in self._sets.values())
        widest = max(self._bits.values(), default=0)
        mask = 0 if widest < 8 else sys.getsizeof(1 << widest)
        total = tables + sys.getsizeof(self.holders) + (INT_BYTES + mask) * len(self.holders)
        if self.host_holders:  # only with host tiers (and then the host sets too)
            total += sum(sys.getsizeof(index.host) for index in self._sets.values())
            total += sys.getsizeof(self.host_holders) + (INT_BYTES + mask) * len(self.host_holders)
        if self.disk_holders or any(index.disk for index in self._sets.values()):
            total += sum(sys.getsizeof(index.disk) for index in self._sets.values())
            total += sys.getsizeof(self.disk_holders) + (INT_BYTES + mask) * len(self.disk_holders)
        return total


def _suffix_from(tier: dict[int, int], bit: int, hashes: tuple[int, ...], depth: int) -> int:
    """Where the blocks of `tier` begin among the worker's first `depth` blocks of `hashes`,
    they being a suffix of them (`depth` when none)."""
    mask, get = 1 << bit, tier.get
    if not depth or not get(hashes[depth - 1], 0) & mask:
        return depth
    low, high = 0, depth - 1  # hashes[high] is in the tier
    while low < high:
        mid = (low + high) // 2
        if get(hashes[mid], 0) & mask:
            high = mid
        else:
            low = mid + 1
    return low
