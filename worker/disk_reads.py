"""`DiskReads`: a disk hit read on a thread of its own, while the engine steps, and only when
reading is priced faster than recomputing (worker/tier_costs.py).

At a sample's first admission the engine asks `begin` for the saved nodes that continue its
prompt past the device and host tiers (worker/kv_persistence.py's catalog). If there are any
and reading them pays, their files are read, checksummed and parsed on the reader thread, one
node at a time; the sample stays queued (samples behind it are admitted meanwhile) and every
other running sample keeps stepping. When every file of its read is in, `finish` inserts the
nodes into the tree on the engine thread (fresh device pages and one copy each) and the sample
starts, hitting them. Before, the whole read happened on the engine thread at admission and
stalled every running request's step for it (30-53 ms of reading and checking for a
1,024-token SmolLM2 turn here).

Samples that need the same node share its read (a request with n samples, or two requests of
one conversation arriving together). A read that fails (the file went missing, a damaged
byte, a file that does not fit) gives None for its node: `attach_read` stops there and the
rest of the prompt is recomputed, never served from it. A sample that ends while its read is
in flight lets go of it; a node nobody waits for any more is dropped (or cancelled if its read
has not begun).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from cache import CacheNamespace, Keys
from worker.kv_persistence import DiskNode, KvStore, StoreIdentity
from worker.tier_costs import TierCosts

if TYPE_CHECKING:
    from worker.engine import Engine

log = logging.getLogger(__name__)
NodeRead = concurrent.futures.Future[tuple[dict[str, torch.Tensor] | None, float]]
"""A node's tensors (None: the read failed) and the seconds the reader spent on it."""


@dataclass(eq=False, slots=True)
class PendingRead:
    """One sample's disk hit in flight."""

    keys: Keys
    namespace: CacheNamespace
    positions: int
    """Positions its nodes add past what the tiers held when it began."""
    held: int
    """Positions of `keys` the device and host tiers held when it began."""
    files: int
    """Positions of the node files it reads (whole, though a hit may use part of the last)."""
    tries: int = 1
    """1 for a sample's first read; 2 for the one that replaces it when the tiers lost part of
    what they held meanwhile (the last)."""
    reads: dict[str, NodeRead] = field(default_factory=dict)

    def done(self) -> bool:
        return all(f.done() for f in self.reads.values())


class DiskReads:
    def __init__(
        self, store: KvStore, costs: TierCosts, wake: Callable[[], None] = lambda: None
    ) -> None:
        self.store = store
        self.costs = costs
        self._wake = wake
        """Called on the reader thread when a node's read ends (the engine's loop may be idle)."""
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-disk-read")
        self._shared: dict[str, tuple[NodeRead, int]] = {}
        """Node name -> its read and how many pending reads wait for it."""
        self.pending = 0
        """Pending reads begun and not yet finished or released (the engine bounds them)."""

    def begin(
        self, engine: Engine, keys: Keys, namespace: CacheNamespace, tries: int = 1
    ) -> PendingRead | None:
        """Start reading the saved nodes that continue `keys` past both tiers (engine thread);
        None when there are none or recomputing them is priced faster."""
        wanted, held = self.store.wanted(engine, keys, namespace)
        if not wanted:
            return None
        positions = wanted[-1][1] - held
        files = sum(node.record.positions for node, _ in wanted)
        config = engine.config
        chunk = min(config.token_budget, config.max_prefill_chunk)
        if not self.costs.read_pays(positions, len(keys) - held - positions, chunk, files):
            return None
        pending = PendingRead(keys, namespace, positions, held, files, tries)
        identity = StoreIdentity.of(engine)
        try:
            for node, _ in wanted:
                pending.reads[node.name] = self._share(node, identity)
        except BaseException:
            self._let_go(pending)
            raise
        self.pending += 1
        return pending

    def finish(self, engine: Engine, pending: PendingRead) -> tuple[int, bool]:
        """Insert what `pending` read (engine thread, once `pending.done()`) and let go of its
        reads. Returns the positions added to the cache, and whether the tiers lost part of
        what they held of its prompt meanwhile (their positions were not read)."""
        began = time.perf_counter()
        lost = self.store.held(engine, pending.keys, pending.namespace) < pending.held
        tensors: dict[str, dict[str, torch.Tensor] | None] = {}
        seconds = 0.0
        for name, future in pending.reads.items():
            try:
                got, spent = future.result()
            except concurrent.futures.CancelledError:  # the reader shut down first
                got, spent = None, 0.0
            tensors[name] = got
            seconds += spent
        try:
            added = self.store.attach_read(engine, pending.keys, pending.namespace, tensors)
        finally:
            self.release(pending)
        if added == pending.positions:  # a failed or cut-short read prices nothing
            self.costs.observe_read(pending.files, seconds + time.perf_counter() - began)
        return added, lost

    def release(self, pending: PendingRead) -> None:
        """`pending`'s sample no longer waits for its reads (engine thread)."""
        if pending.reads:
            self.pending -= 1
        self._let_go(pending)

    def close(self) -> None:
        """Stop reading: reads not begun are cancelled, one under way is not waited for."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _let_go(self, pending: PendingRead) -> None:
        for name in pending.reads:
            shared = self._shared.get(name)
            if shared is None:
                continue
            future, waiting = shared
            if waiting > 1:
                self._shared[name] = (future, waiting - 1)
            else:
                del self._shared[name]
                future.cancel()  # not begun: never read; begun or done: its tensors go
        pending.reads.clear()

    def _share(self, node: DiskNode, identity: StoreIdentity) -> NodeRead:
        shared = self._shared.get(node.name)
        if shared is not None:
            self._shared[node.name] = (shared[0], shared[1] + 1)
            return shared[0]
        future = self._pool.submit(self._read, node, identity)
        future.add_done_callback(lambda _: self._wake())
        self._shared[node.name] = (future, 1)
        return future

    def _read(
        self, node: DiskNode, identity: StoreIdentity
    ) -> tuple[dict[str, torch.Tensor] | None, float]:
        began = time.perf_counter()
        try:
            tensors = self.store.read(node.record, identity)
        except Exception:  # the cache on disk must never fail a request
            log.exception("reading saved node %s failed", node.name)
            tensors = None
        return tensors, time.perf_counter() - began
