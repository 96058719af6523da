"""Round robin: each request to the next worker in join order. Blind to caches and load.

A baseline; it must never skip a worker, busy or not.
"""

from __future__ import annotations

from router.base import BaseRouter
from router.interface import RouteDecision, RouteRequest


class RoundRobin(BaseRouter):
    name = "round_robin"
    tracks_blocks = False

    _next = 0

    def choose(self, request: RouteRequest, now: float) -> RouteDecision:
        order = self.members.order
        worker = order[self._next % len(order)]
        self._next += 1
        return RouteDecision(worker, 0)
