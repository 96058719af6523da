"""The disk tier's write on eviction: a node the cache drops from the last tier that held it is
written to the worker's cache directory (worker/kv_persistence.py) instead of vanishing.

    eviction (engine thread) --on_drop(node)--> it and its unsaved ancestors, named as a save
                                                names them; nothing if all are on disk
      --SpillCopy, in order with the tier copies--> the runner reads its pages to the CPU
      --queue--> the saver's thread writes the file and lists it in the manifest

Without it the disk holds what the last save wrote: a prefix cached and evicted from both tiers
between two saves (`persist_interval_s`, 60 s by default) was gone. With it, what eviction
drops is kept while `persist_max_bytes` allows (docs/decisions.md 58).

Costs and bounds:
- On the engine thread, `on_drop` names the node (a digest of its keys and of each ancestor's,
  as `KvStore.records` does) and the runner copies its pages out before they can be reused: a
  memory copy of the dropped leaf (a spilling tree moves and drops leaves whole, so each page
  is copied once) and, once, of the ancestors the store lacks.
- What is queued and not yet written stays under `max_queued_bytes` (an empty queue takes any
  one drop); a node past it is dropped as it was before (`skipped_pages`), so a slow disk
  never holds memory or the engine. A `SpillCopy` that never runs gives back what its drop
  reserved (`lose`).
- A node is read back along the catalog's paths from its namespace's root, so a spill writes
  the dropped node's ancestors too where the store does not have them (they are still cached:
  their pages are read in the same order, before any later move). Names chain through the
  parents as the tree has them now; a later split of a parent names its parts anew, and the
  whole parent already on disk keeps leading to what hangs below it.

Thread rules: `on_drop`, `take` and `lose` run on the engine thread; `write_queued` on the saver's
thread (worker/kv_persistence.py, `BackgroundSaver`), or with the engine stopped.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cache import Node
from worker.kv_persistence import KvStore, NodeRecord, _namespace_fields, _node_name

if TYPE_CHECKING:
    from worker.engine import Engine


@dataclass(frozen=True, slots=True)
class Spilled:
    """A dropped node on its way to disk: its record (named as a save would name it), its
    keys, and the bytes its K and V take while queued."""

    record: NodeRecord
    keys: bytes
    nbytes: int


class DiskSpill:
    """Writes the nodes eviction drops to `store`: wire `on_drop` to the cache's tree and
    `take` to the runner's `spill`."""

    def __init__(self, engine: Engine, store: KvStore, max_queued_bytes: int = 256 << 20) -> None:
        self.store = store
        self.max_queued_bytes = max_queued_bytes
        self.page_bytes = engine.runner.page_bytes
        self.spilled_pages = 0
        """Pages of dropped nodes written to disk."""
        self.skipped_pages = 0
        """Pages of dropped nodes not on disk and not written: the queue was full."""
        self._queue: queue.SimpleQueue[tuple[Spilled, torch.Tensor, torch.Tensor] | None] = (
            queue.SimpleQueue()
        )
        self._queued_bytes = 0
        self._queued: set[str] = set()
        """Names of the nodes queued and not yet written."""
        self._lock = threading.Lock()

    # -- engine thread -------------------------------------------------------------------------
    def on_drop(self, node: Node) -> list[tuple[Node, Spilled]]:
        """What to write of `node`, which eviction is taking out of the tree (still attached),
        and of its ancestors: each of them the store has not written and no spill has queued
        yet, parents first, so the dropped node can be listed (and read back) at once. Nothing
        when the store has all of it, or when the queue cannot take it all."""
        path = []
        root = node
        while root.parent is not None:
            path.append(root)
            root = root.parent
        assert root.namespace is not None
        ns = _namespace_fields(root.namespace)
        wanted: list[tuple[Node, NodeRecord]] = []
        parent: str | None = None
        for at in reversed(path):
            name = _node_name(parent, ns, at)
            if name in self.store.unwritable:
                return []  # it, or a node above it, can never be written
            if name not in self.store.written and name not in self._queued:
                used, blocks = at.last_access, tuple(at.blocks)
                record = NodeRecord(name, parent, ns, at.start, len(at.keys), used, blocks=blocks)
                wanted.append((at, record))
            parent = name
        if not wanted or wanted[-1][0] is not node:
            return []  # the dropped node is on disk or on its way
        spills = [
            (at, Spilled(record, at.keys.tobytes(), len(at.pages) * self.page_bytes))
            for at, record in wanted
        ]
        nbytes = sum(spilled.nbytes for _, spilled in spills)
        with self._lock:  # an empty queue takes any one drop: a long prefix is no exception
            if self._queued_bytes and self._queued_bytes + nbytes > self.max_queued_bytes:
                self.skipped_pages += len(node.pages)
                return []
            self._queued_bytes += nbytes
            self._queued.update(record.name for _, record in wanted)
        return spills

    def take(self, token: object, k: torch.Tensor, v: torch.Tensor) -> None:
        """The K and V of a spilled node's pages, read before they were reused: queue them."""
        assert isinstance(token, Spilled)
        self._queue.put((token, k, v))

    def lose(self, token: object) -> None:
        """A spilled node whose pages were never read (the copies before it failed): let go of
        what `on_drop` reserved for it."""
        assert isinstance(token, Spilled)
        self._release(token)

    def _release(self, spilled: Spilled) -> None:
        with self._lock:
            self._queued_bytes -= spilled.nbytes
            self._queued.discard(spilled.record.name)

    # -- the saver's thread --------------------------------------------------------------------
    def wake(self) -> None:
        """Let a `write_queued` waiting for the first node return."""
        self._queue.put(None)

    def write_queued(self, timeout: float = 0.0) -> int:
        """Write the nodes queued by the time the first arrives (waiting up to `timeout` s for
        it), not those queued meanwhile: under steady eviction the queue never empties, and
        the caller must get to list them. Returns how many were written; the next
        `KvStore.write_manifest` lists them. A write that fails (or finds the disk full) loses
        its node and the rest of the batch (their reservations let go); an error goes to the
        caller."""
        try:
            items = [self._queue.get(timeout > 0, timeout if timeout > 0 else None)]
        except queue.Empty:
            return 0
        for _ in range(self._queue.qsize()):
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        nodes = [item for item in items if item is not None]
        written = 0
        try:
            for spilled, k, v in nodes:
                if not self.store.write_spilled(spilled.record, spilled.keys, k, v):
                    break
                if spilled.record.name in self.store.written:
                    self.spilled_pages += k.shape[1]
                    written += 1
        finally:
            for spilled, _, _ in nodes:
                self._release(spilled)
        return written
