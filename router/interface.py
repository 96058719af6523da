"""The contract between routing policies and whatever drives them (the simulator, the router actor).

A policy sees requests as routing keys, and workers as an exact index of the blocks they hold
plus the load routed to them. It returns one worker per request. The driver feeds it, in order:

    add_worker / remove_worker          membership (a removed worker's index is dropped)
    apply_event(worker, KvEvent)        stored / removed / cleared blocks, numbered per worker;
                                        False means a gap: call load_snapshot before trusting it
    load_snapshot(worker, KvSnapshot)   a worker's whole block set (after a gap, or on (re)join)
    route(RouteRequest) -> RouteDecision
    route_burst([RouteRequest]) -> [(RouteRequest, RouteDecision)]
                                        requests that arrived together, in the order to dispatch
                                        them (a policy may reorder; routing each with `route`
                                        in arrival order is always a valid driver)
    prefill_done(worker, request_id)    the request's prompt is computed (its load leaves the queue)
    finished(worker, request_id)        the request is over (its KV occupancy is released)
    report_load(worker, WorkerLoad)     the worker's own view, when it has one (optional)
    report_adapters(worker, WorkerAdapters)
                                        the LoRA adapters it holds and has resident, its swap
                                        seconds (router/adapters.py); a request whose
                                        namespace.adapter is set goes only to a worker holding it
    calibrate(ServiceRates)             prefill rate and decode cost learned from the streams

Block hashes are the cache package's `BlockHasher` hashes under the workers' `IdentityScheme`:
the router never computes a second kind. Nothing here is thread-safe; one driver thread calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from cache import CacheNamespace, KvEvent, KvSnapshot
from router.adapters import WorkerAdapters
from router.service_model import ServiceRates

WorkerId = str


@dataclass(frozen=True, slots=True)
class RouteRequest:
    request_id: str
    namespace: CacheNamespace
    block_hashes: tuple[int, ...]
    """Chained hashes of the prompt's complete routing blocks (cache.BlockHasher)."""
    num_tokens: int
    """Prompt length in tokens (KV positions), complete blocks and the partial tail."""
    priority: int = 0
    """Lower first, as the workers' `priority` scheduling policy admits them: a request waits
    only for queued work of its priority or a more urgent one (0 for every request under
    fcfs)."""

    def __post_init__(self) -> None:
        if self.num_tokens < 0:  # it would book negative work on the worker
            raise ValueError(
                f"request {self.request_id!r}: num_tokens must be >= 0, got {self.num_tokens}"
            )


@dataclass(frozen=True, slots=True)
class RouteDecision:
    worker: WorkerId
    predicted_cached_tokens: int
    """What the policy expects the worker to serve from its cache (compare with what it does)."""


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's own report of its state (tokens and pages, never just request counts)."""

    queued_prefill_tokens: int
    running_sequences: int
    free_pages: int
    total_pages: int


class RoutingPolicy(Protocol):
    name: str

    def add_worker(self, worker: WorkerId, capacity_tokens: int) -> None: ...

    def remove_worker(self, worker: WorkerId) -> None: ...

    def apply_event(self, worker: WorkerId, event: KvEvent) -> bool: ...

    def load_snapshot(self, worker: WorkerId, snapshot: KvSnapshot) -> None: ...

    def route(self, request: RouteRequest) -> RouteDecision: ...

    def route_burst(
        self, requests: Sequence[RouteRequest]
    ) -> list[tuple[RouteRequest, RouteDecision]]:
        """Route requests that are waiting together; dispatch them in the returned order."""
        ...

    def prefill_done(self, worker: WorkerId, request_id: str) -> None: ...

    def finished(self, worker: WorkerId, request_id: str) -> None: ...

    def report_load(self, worker: WorkerId, load: WorkerLoad) -> None: ...

    def report_adapters(self, worker: WorkerId, adapters: WorkerAdapters) -> None: ...

    def calibrate(self, rates: ServiceRates) -> None:
        """Cost time with rates learned from the served streams (router/service_model.py)."""
        ...

    def deeper_holder(
        self, request: RouteRequest, worker: WorkerId, least: int = 1
    ) -> tuple[WorkerId, int] | None:
        """Another worker whose device holds at least `least` more positions of the request's
        prompt than `worker` holds, with the positions it holds (None: none, or the policy
        tracks no blocks)."""
        ...

    def index_bytes(self) -> int:
        """Memory held by the per-worker indexes (counted, for reports and bounds)."""
        ...
