"""KV events: what a worker's cache gained or lost, as block hashes, in order.

The producer side (`KvEventPublisher`) numbers every event of one source 1, 2, 3, ... and hands
it to any number of subscribers, synchronously and in order; subscribers must be cheap (put it on
a queue). The consumer side (`BlockSetIndex`) applies events to a set of block hashes and notices
a gap in the numbers, so a consumer that missed an event asks for a snapshot instead of drifting.

With a host tier a block keeps its place in the set while its pages move: `demoted` says the
blocks now live in host memory, `promoted` that they are back on the device. A consumer that
knows nothing of tiers can treat both as no change.

A worker that saves its cache to disk also says which blocks its saved files hold: `saved` and
`unsaved` change a second set, `disk`, apart from the cache's own blocks (a block may be in
both, or on disk alone after the cache dropped it). The saved nodes keep their parents, so the
disk set is prefix-closed like the cache's. `cleared` empties the cache's set, not the disk's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum


class KvEventKind(Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"
    DEMOTED = "demoted"
    PROMOTED = "promoted"
    SAVED = "saved"
    UNSAVED = "unsaved"


@dataclass(frozen=True, slots=True)
class KvEvent:
    source: str
    seq: int
    """1 for a source's first event, then +1 per event; a consumer checks there is no gap."""
    kind: KvEventKind
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KvSnapshot:
    source: str
    seq: int
    """The number of the last event already reflected in `block_hashes`."""
    block_hashes: frozenset[int]
    host_block_hashes: frozenset[int] = frozenset()
    """The blocks of `block_hashes` whose pages are in the host tier."""
    disk_block_hashes: frozenset[int] = frozenset()
    """The blocks the source's saved files hold (in `block_hashes` or not)."""


Subscriber = Callable[[KvEvent], None]


class KvEventPublisher:
    """Numbers one source's events and delivers them to its subscribers."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.seq = 0
        self._subscribers: list[Subscriber] = []

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Deliver every later event to `subscriber`; returns a function that unsubscribes."""
        self._subscribers.append(subscriber)

        def unsubscribe() -> None:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)

        return unsubscribe

    def publish(self, kind: KvEventKind, block_hashes: Iterable[int] = ()) -> KvEvent | None:
        hashes = tuple(block_hashes)
        if not hashes and kind is not KvEventKind.CLEARED:
            return None
        self.seq += 1
        event = KvEvent(self.source, self.seq, kind, hashes)
        for subscriber in list(self._subscribers):
            subscriber(event)
        return event


class BlockSetIndex:
    """The set of block hashes one source holds, rebuilt from its events or a snapshot."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.seq = 0
        self.blocks: set[int] = set()
        self.host: set[int] = set()
        """The blocks of `blocks` in the host tier."""
        self.disk: set[int] = set()
        """The blocks the source's saved files hold (`saved` / `unsaved`; apart from `blocks`)."""
        self.in_sync = True
        """False after a gap: events are ignored until `load_snapshot`."""

    def apply(self, event: KvEvent) -> bool:
        """Apply the next event; False (and out of sync) if an event is missing before it."""
        if event.source != self.source:
            raise ValueError(f"event from {event.source!r} applied to index of {self.source!r}")
        if not self.in_sync:
            return False
        if event.seq <= self.seq:
            return True  # already reflected (a snapshot taken after it, or a redelivery)
        if event.seq != self.seq + 1:
            self.in_sync = False
            return False
        self.seq = event.seq
        kind = event.kind
        if kind is KvEventKind.STORED:
            self.blocks.update(event.block_hashes)
        elif kind is KvEventKind.REMOVED:
            self.blocks.difference_update(event.block_hashes)
            if self.host:
                self.host.difference_update(event.block_hashes)
        elif kind is KvEventKind.DEMOTED:
            self.host.update(event.block_hashes)
        elif kind is KvEventKind.PROMOTED:
            self.host.difference_update(event.block_hashes)
        elif kind is KvEventKind.SAVED:
            self.disk.update(event.block_hashes)
        elif kind is KvEventKind.UNSAVED:
            self.disk.difference_update(event.block_hashes)
        else:
            self.blocks.clear()
            self.host.clear()
        return True

    def load_snapshot(self, snapshot: KvSnapshot) -> None:
        if snapshot.source != self.source:
            raise ValueError(f"snapshot of {snapshot.source!r} loaded into {self.source!r}")
        self.blocks = set(snapshot.block_hashes)
        self.host = set(snapshot.host_block_hashes)
        self.disk = set(snapshot.disk_block_hashes)
        self.seq = snapshot.seq
        self.in_sync = True
