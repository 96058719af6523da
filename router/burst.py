"""The dispatch order of a burst: requests that reach the router at the same instant.

Workers serve their queues first come, first served, so the order in which a burst is routed
decides who waits behind whom. Routing it in arrival order lets a long prefill that happened to
come first take the idle worker that a short request of the same burst then waits for. The
router instead dispatches:

    1. the very long requests first (predicted prefill >= tail_s): their TTFT is the tail, and
       a wait in front of them would add to it;
    2. then the rest, shortest predicted prefill first (SPT), so that short requests (the bulk
       of the distribution) wait behind as little as possible.

The prediction is the request's uncached tokens on its best-matching worker (exact index plus
pending routes) over the prefill rate. Must never delay a request: the order only matters among
requests that are all waiting to be routed now. A lone request is routed as it comes.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, insort
from collections.abc import Sequence


def shortest_first(predicted_prefill_s: Sequence[float], tail_s: float) -> list[int]:
    """The positions of a burst's requests, given their predicted prefills, in dispatch order:
    predicted prefill >= `tail_s` first (longest first), then the rest shortest first; ties
    keep arrival order."""
    keys = [-own if own >= tail_s else own for own in predicted_prefill_s]
    return sorted(range(len(keys)), key=keys.__getitem__)


class TailEstimate:
    """A running quantile of recent predicted prefill times: where "very long" starts.

    Keeps the last `window` samples in arrival order (a ring) and in sorted order (bisect in,
    bisect out: O(log n) search and a short memmove per sample, no periodic re-sort), both as
    contiguous arrays of doubles: the router calls `add` on every decision, between dictionary
    walks that push everything else out of the CPU's caches, and a list of float objects would
    cost a cache miss per comparison. `fallback_s` stands until `warmup` samples were kept.

    With `stride` k > 1 it keeps only every k-th sample: the same horizon in k times fewer
    samples (`window` counts samples kept), k times fewer sorted inserts, and a quantile from a
    sample of the recent values instead of all of them.
    """

    def __init__(
        self,
        quantile: float = 0.97,
        fallback_s: float = 5.0,
        window: int = 2048,
        warmup: int = 64,
        stride: int = 1,
    ) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must lie in (0, 1), got {quantile}")
        if not 1 <= warmup <= window or stride < 1:  # warmup 0: `value` of no samples
            raise ValueError(
                f"need 1 <= warmup <= window samples and stride >= 1, got warmup {warmup}, "
                f"window {window}, stride {stride}"
            )
        self.quantile = quantile
        self.fallback_s = fallback_s
        self._warmup = warmup
        self._ring = array("d", bytes(8 * window))
        self._next = 0
        self._sorted = array("d")
        self._stride = stride
        self._skip = 0
        self.value = fallback_s
        """The quantile of the samples kept (`fallback_s` until `warmup` were kept), updated
        as each is kept: the router reads it on every decision."""

    def add(self, seconds: float) -> None:
        if self._skip:
            self._skip -= 1
            return
        self._skip = self._stride - 1
        ordered, ring, at = self._sorted, self._ring, self._next
        if len(ordered) == len(ring):
            del ordered[bisect_left(ordered, ring[at])]
        ring[at] = seconds
        self._next = at + 1 if at + 1 < len(ring) else 0
        insort(ordered, seconds)
        if len(ordered) >= self._warmup:
            self.value = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]
