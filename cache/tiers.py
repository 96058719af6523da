"""Where a node's pages live, and the copies between tiers that the worker performs.

    device pool --demote (evicted, host has room)--> host pool --evicted there--> gone
         ^------------- promote (a match reaches it) -----/                  (or spilled)

A node's pages are all in one tier. Along any path from a root the device nodes come first:
a node is demoted only when no child of it is on the device, and promoting a node promotes
everything above it. The tree changes its bookkeeping at once and queues a `TierCopy` for the
bytes; the worker performs queued copies in the order given, before its next forward pass and
before any `PageCopy` handed out after them, so a page freed by a demotion is read before it
is written again.

A node leaving the last tier it was in is gone unless the cache's `on_drop` asks to keep it:
then a `SpillCopy` is queued in the same order, so the worker reads the node's pages (for its
disk tier, worker/disk_spill.py) before a later copy, page copy or forward pass reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, TypeAlias

from cache.page_pool import PageIds

DEVICE: Final = 0
HOST: Final = 1
TIER_NAMES: Final = {DEVICE: "device", HOST: "host"}


@dataclass(frozen=True, slots=True)
class TierCopy:
    """Copy whole pages `src_pages` of tier `src_tier` to `dst_pages` of `dst_tier`, pairwise
    (every layer, K and V)."""

    src_tier: int
    src_pages: PageIds
    dst_tier: int
    dst_pages: PageIds

    def __post_init__(self) -> None:
        if len(self.src_pages) != len(self.dst_pages):
            raise ValueError(
                f"a tier copy pairs pages: {len(self.src_pages)} sources, "
                f"{len(self.dst_pages)} destinations"
            )


@dataclass(frozen=True, slots=True)
class SpillCopy:
    """Read whole pages `pages` of tier `tier` (every layer, K and V) and hand them with `token`
    to whoever asked for them, before those pages are reused: they held a node that eviction
    dropped from the tree, and `token` is what the cache's `on_drop` returned for it."""

    tier: int
    pages: PageIds
    token: object


QueuedCopy: TypeAlias = TierCopy | SpillCopy
"""What the tree queues for the worker, in the order it must run."""
