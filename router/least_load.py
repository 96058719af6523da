"""Least load: the worker with the fewest prefill tokens routed to it and not yet computed.

Ties (idle workers) go to the fewest requests in flight, then round robin. Blind to caches;
it must never wait for a worker's report to count a route (a burst would herd).
"""

from __future__ import annotations

from router.base import BaseRouter
from router.interface import RouteDecision, RouteRequest


class LeastLoad(BaseRouter):
    name = "least_load"
    tracks_blocks = False

    _turn = 0

    def choose(self, request: RouteRequest, now: float) -> RouteDecision:
        order, states = self.members.order, self.loads.workers
        n = len(order)
        self._turn += 1
        best = min(
            range(n),
            key=lambda i: (
                states[order[i]].queued_tokens,
                states[order[i]].running,
                (i - self._turn) % n,
            ),
        )
        return RouteDecision(order[best], 0)
