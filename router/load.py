"""Load in tokens, counted at the moment of routing, from the router's own routes.

Per worker: prefill tokens routed there and not yet computed (as predicted when routed), the KV
of requests prefilled and not finished, requests in flight, and `free_at`, the time its queued
prefill work should be done if it drains at `prefill_rate` tokens/s from the last moment the
router knew exactly where the worker stood (a route to an idle worker, or a `prefill_done`).
`free_at` does not change as time passes, so `by_free`, the workers ordered by it, never goes
stale: its head is the worker that frees up first, idle workers (free_at <= now) longest idle
first.

A worker's own `WorkerLoad` report, when the driver has one, is kept beside the router's count
and never replaces it: a report arrives after the fact, and a router that waits for it sends a
whole burst to the worker that looked idle.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field

from router.interface import WorkerId, WorkerLoad


@dataclass(slots=True)
class WorkerState:
    bit: int
    capacity_tokens: int
    queued_tokens: int = 0
    """Predicted prefill tokens routed here and not yet computed."""
    queued_requests: int = 0
    running: int = 0
    """Requests routed here and not finished."""
    kv_tokens: int = 0
    """KV positions of requests prefilled here and not finished."""
    free_at: float = 0.0
    """When the queued prefill work should be done (seconds on the policy's clock)."""
    routed_tokens: int = 0
    """Prefill tokens ever routed here (a counter for reports)."""
    reported: WorkerLoad | None = None
    by_priority: dict[int, int] = field(default_factory=dict)
    """Of `queued_tokens`, those of priorities other than 0, by priority (empty: all at 0)."""


@dataclass(slots=True)
class _Route:
    worker: WorkerId
    prefill_tokens: int
    kv_tokens: int
    prefilled: bool = False
    priority: int = 0


class LoadBook:
    def __init__(self, prefill_rate: float) -> None:
        if prefill_rate <= 0:
            raise ValueError(f"prefill_rate must be > 0 tokens/s, got {prefill_rate}")
        self.prefill_rate = prefill_rate
        self.workers: dict[WorkerId, WorkerState] = {}
        self.by_free: list[tuple[float, int]] = []
        """(free_at, bit) of every worker, ascending."""
        self.queued_tokens = 0
        """Sum of every worker's queued prefill tokens."""
        self.prioritized = 0
        """Queued (not yet prefilled) routes of a priority other than 0 with tokens to prefill:
        while there are none, every queued token is at 0."""
        self._routes: dict[str, _Route] = {}

    def add(self, worker: WorkerId, bit: int, capacity_tokens: int, now: float) -> None:
        self.workers[worker] = WorkerState(bit, capacity_tokens, free_at=now)
        insort(self.by_free, (now, bit))

    def remove(self, worker: WorkerId) -> None:
        state = self.workers.pop(worker)
        self._unlist(state)
        self.queued_tokens -= state.queued_tokens
        for request_id in [r for r, route in self._routes.items() if route.worker == worker]:
            route = self._routes.pop(request_id)
            self.prioritized -= bool(
                route.priority and route.prefill_tokens and not route.prefilled
            )

    def wait_s(self, worker: WorkerId, now: float) -> float:
        """Seconds a request routed to `worker` now would wait before its prefill starts."""
        return max(0.0, self.workers[worker].free_at - now)

    @staticmethod
    def ahead(state: WorkerState, priority: int) -> float:
        """The share of `state`'s queued prefill tokens a request of `priority` waits for: those
        of its priority or a more urgent one (the workers admit it before the rest)."""
        if not state.queued_tokens:
            return 1.0
        later = sum(tokens for p, tokens in state.by_priority.items() if p > priority)
        if priority < 0:  # the requests at 0 are less urgent too
            later += state.queued_tokens - sum(state.by_priority.values())
        return (state.queued_tokens - later) / state.queued_tokens

    def routed(
        self,
        request_id: str,
        worker: WorkerId,
        prefill_tokens: int,
        kv_tokens: int,
        now: float,
        priority: int = 0,
    ) -> None:
        """Book the request on `worker`. An id still in flight is routed anew: its earlier
        booking ends first (as `finished` would), or its work would stay queued for good."""
        state = self.workers[worker]
        if request_id in self._routes:
            self.finished(request_id, now)
        self._routes[request_id] = _Route(worker, prefill_tokens, kv_tokens, priority=priority)
        if priority and prefill_tokens:
            state.by_priority[priority] = state.by_priority.get(priority, 0) + prefill_tokens
            self.prioritized += 1
        start = now if state.queued_requests == 0 else max(state.free_at, now)
        self._move(state, start + prefill_tokens / self.prefill_rate)
        state.queued_tokens += prefill_tokens
        state.queued_requests += 1
        state.running += 1
        state.routed_tokens += prefill_tokens
        self.queued_tokens += prefill_tokens

    def prefill_done(self, request_id: str, now: float) -> bool:
        """False if the request is unknown or already prefilled."""
        route = self._routes.get(request_id)
        if route is None or route.prefilled:
            return False
        route.prefilled = True
        state = self.workers[route.worker]
        self._dequeue_priority(state, route)
        state.queued_tokens -= route.prefill_tokens
        state.queued_requests -= 1
        state.kv_tokens += route.kv_tokens
        self.queued_tokens -= route.prefill_tokens
        # FCFS: the next queued prefill starts now; what remains is exactly the queue
        self._move(state, now + state.queued_tokens / self.prefill_rate)
        return True

    def finished(self, request_id: str, now: float) -> bool:
        """False if the request is unknown (finished already, or routed before a restart)."""
        route = self._routes.pop(request_id, None)
        if route is None:
            return False
        state = self.workers[route.worker]
        state.running -= 1
        if route.prefilled:
            state.kv_tokens -= route.kv_tokens
            return True
        # aborted before its prefill was done: its predicted work leaves the queue
        self._dequeue_priority(state, route)
        state.queued_tokens -= route.prefill_tokens
        state.queued_requests -= 1
        self.queued_tokens -= route.prefill_tokens
        left = state.free_at - route.prefill_tokens / self.prefill_rate
        self._move(state, max(now, left) if state.queued_requests else now)
        return True

    def worker_of(self, request_id: str) -> WorkerId | None:
        route = self._routes.get(request_id)
        return None if route is None else route.worker

    def _dequeue_priority(self, state: WorkerState, route: _Route) -> None:
        if not (route.priority and route.prefill_tokens):
            return
        left = state.by_priority[route.priority] - route.prefill_tokens
        if left:
            state.by_priority[route.priority] = left
        else:
            del state.by_priority[route.priority]
        self.prioritized -= 1

    def _move(self, state: WorkerState, free_at: float) -> None:
        self._unlist(state)
        state.free_at = free_at
        insort(self.by_free, (free_at, state.bit))

    def _unlist(self, state: WorkerState) -> None:
        entry = (state.free_at, state.bit)
        i = bisect_left(self.by_free, entry)
        assert self.by_free[i] == entry, "by_free lost track of a worker"
        del self.by_free[i]
