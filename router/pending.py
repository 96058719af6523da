"""Routes sent to a worker but not yet confirmed by its KV events.

A request routed to worker W will, once W prefills it, make W hold its blocks; W's `stored`
event says so only then, seconds later behind W's queue. Until that event, a second request with
the same new prefix would see no holder and go elsewhere, and a burst would scatter. So each
route records its blocks here as "expected on W", and the router counts them as cached on W.

An entry lives until its request's prefill is done plus a short grace for the `stored` event to
arrive (`settle`), and never longer than `ttl_s` after routing: a lost request cannot pin a
prediction forever. Entries are not reference-counted: when one is dropped its blocks stop
being pending on W even if a later route to W named them too. By then the earlier route's
`stored` event has confirmed them (the blocks of a later route to the same worker that are not
the earlier one's stay pending), so the index, the truth, holds them. Must never be read as the
truth itself.
"""

from __future__ import annotations

import heapq
import sys

from router.block_index import mark, unmark


class PendingRoutes:
    def __init__(self, ttl_s: float = 60.0, grace_s: float = 1.0) -> None:
        if ttl_s <= 0 or grace_s < 0:
            raise ValueError(f"need ttl_s > 0 and grace_s >= 0, got {ttl_s}, {grace_s}")
        self.ttl_s = ttl_s
        self.grace_s = grace_s
        self.holders: dict[int, int] = {}
        """Block hash -> mask of workers expected to hold it."""
        self._routes: dict[str, tuple[int, tuple[int, ...], float]] = {}
        """Request id -> (worker bit, its expected blocks, deadline)."""
        self._deadlines: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._routes)

    def add(self, request_id: str, bit: int, blocks: tuple[int, ...], now: float) -> None:
        """Expect the worker of `bit` to hold `blocks` until settled or `ttl_s` from now."""
        self.drop(request_id)
        if not blocks:
            return
        deadline = now + self.ttl_s
        self._routes[request_id] = (bit, blocks, deadline)
        heapq.heappush(self._deadlines, (deadline, request_id))
        mark(self.holders, bit, blocks)

    def settle(self, request_id: str, now: float) -> None:
        """The request's prefill is done: keep its entry only for the event's grace period."""
        route = self._routes.get(request_id)
        if route is None:
            return
        deadline = now + self.grace_s
        if deadline < route[2]:
            self._routes[request_id] = (route[0], route[1], deadline)
            heapq.heappush(self._deadlines, (deadline, request_id))

    def expire(self, now: float) -> None:
        """Drop every entry whose deadline has passed."""
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, request_id = heapq.heappop(heap)
            route = self._routes.get(request_id)
            if route is not None and route[2] == deadline:
                self.drop(request_id)

    def drop(self, request_id: str) -> None:
        route = self._routes.pop(request_id, None)
        if route is not None:
            unmark(self.holders, route[0], route[1])

    def drop_worker(self, bit: int) -> None:
        """Forget every route to the worker of `bit` (it left the cluster)."""
        for request_id in [r for r, route in self._routes.items() if route[0] == bit]:
            self.drop(request_id)

    def nbytes(self) -> int:
        """Bytes held: the dicts' and heap's tables and the routes' block tuples."""
        routes = sum(sys.getsizeof(route[1]) for route in self._routes.values())
        return (
            sys.getsizeof(self.holders)
            + sys.getsizeof(self._routes)
            + sys.getsizeof(self._deadlines)
            + routes
        )
