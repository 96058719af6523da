"""Least own TTFT: the greedy baseline with the exact cache view.

The cost of a worker is this request's own time to first token there: its queued prefill work
(the part of its priority or a more urgent one, as cache_aware counts it) plus the request's
uncached tokens over the prefill rate, cached tokens read from the exact
block index and pending routes. It ignores what the choice costs later requests (no work term,
no load guard, bursts routed as they come), which is where it loses (docs/router.md). A baseline
for `cache_aware`, which it is with those terms switched off; never tune it to win.
"""

from __future__ import annotations

import time

from router.base import Clock
from router.cache_aware import CacheAware
from router.config import RouterConfig


class LeastTtft(CacheAware):
    name = "least_ttft"

    def __init__(
        self, config: RouterConfig | None = None, clock: Clock = time.monotonic, burst: bool = False
    ) -> None:
        """`burst=True` (an ablation only) dispatches bursts as cache_aware does."""
        super().__init__(config, clock, work_weight=0.0, epsilon=float("inf"), burst=burst)
