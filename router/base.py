"""What every routing policy shares: membership, the exact block index, unconfirmed routes,
load in tokens. A policy subclasses `BaseRouter` and writes one method, `choose`.

`route` asks `choose` for a worker, then books the request's predicted prefill work on it and,
for policies that track blocks, records the route as pending on that worker (router/pending.py).
The clock is the constructor's `clock` callable (seconds): `time.monotonic` in the router actor,
the simulated time in benchmarks/router_sim.py. Nothing here is thread-safe; one driver thread
calls it. Must never import `worker` or torch: the router runs in its own light process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from cache import KvEvent, KvSnapshot
from router.adapters import AdapterBook, WorkerAdapters
from router.block_index import BlockIndex
from router.config import RouterConfig, default_disk_rate, default_host_rate
from router.errors import NoWorkers
from router.interface import RouteDecision, RouteRequest, WorkerId, WorkerLoad
from router.load import LoadBook
from router.members import Members
from router.pending import PendingRoutes
from router.service_model import ServiceRates

Clock = Callable[[], float]


class BaseRouter:
    name = "base"
    tracks_blocks = True
    """Whether KV events feed an exact block index (False: events are acknowledged, unused)."""
    adapter_aware = False
    """Whether `choose` itself keeps a LoRA request to workers holding its adapter (False:
    `route` moves a request that `choose` sent elsewhere to the least loaded holder)."""

    def __init__(self, config: RouterConfig | None = None, clock: Clock = time.monotonic) -> None:
        """`clock`: seconds, monotonic (the simulator passes its simulated time)."""
        self.config = config = config or RouterConfig()
        self.prefill_rate = config.prefill_rate
        self.block_tokens = config.block_tokens
        self.clock = clock
        self.members = Members()
        self.index = BlockIndex()
        self.pending = PendingRoutes(config.pending_ttl_s, config.pending_grace_s)
        self.loads = LoadBook(config.prefill_rate)
        self.decode_s = 0.0
        """Seconds each running request adds to a new request's first token on its worker
        (0 until `calibrate`: the reference service model has no decode)."""
        self.host_rate = config.host_rate or default_host_rate(config.prefill_rate)
        """Tokens per second copied back from a worker's host tier (a policy prices a host
        hit by it against recomputing)."""
        self.disk_rate = config.disk_rate or default_disk_rate(config.prefill_rate)
        """Tokens per second read back from a worker's saved cache (a disk hit's price)."""
        self.peer_rate = config.peer_rate
        """Tokens per second a worker reads from another's cache (`kv_peer`); None: moves
        are priced as recomputes (a policy that prices reads: cache_aware)."""
        self.adapters = AdapterBook(config.adapter_swap_s)
        """The LoRA adapters each worker holds and has resident (router/adapters.py)."""

    # -- membership ----------------------------------------------------------------------------
    def add_worker(self, worker: WorkerId, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens of {worker!r} must be >= 0, got {capacity_tokens}")
        bit = self.members.add(worker)
        self.index.add(worker, bit)
        self.loads.add(worker, bit, capacity_tokens, self.clock())
        self.adapters.add(worker, bit)

    def remove_worker(self, worker: WorkerId) -> None:
        """Drop the worker, its index (O(its blocks)), its pending routes and its load."""
        bit = self.members.remove(worker)
        self.index.remove(worker)
        self.pending.drop_worker(bit)
        self.loads.remove(worker)
        self.adapters.remove(worker)

    # -- what workers hold ---------------------------------------------------------------------
    def apply_event(self, worker: WorkerId, event: KvEvent) -> bool:
        """Apply the worker's next KV event; False after a gap: call `load_snapshot`."""
        self.members.require(worker)
        return self.index.apply(worker, event) if self.tracks_blocks else True

    def load_snapshot(self, worker: WorkerId, snapshot: KvSnapshot) -> None:
        self.members.require(worker)
        if self.tracks_blocks:
            self.index.load_snapshot(worker, snapshot)

    # -- requests ------------------------------------------------------------------------------
    def route(self, request: RouteRequest) -> RouteDecision:
        if not self.members:
            raise NoWorkers(request.request_id)
        now = self.clock()
        if self.tracks_blocks:
            self.pending.expire(now)
        decision = self.choose(request, now)
        adapter = request.namespace.adapter
        if adapter is not None and not self.adapter_aware:
            decision = self._to_holder(decision, request, adapter)
        worker = decision.worker
        cached = min(decision.predicted_cached_tokens, request.num_tokens)
        self.loads.routed(
            request.request_id,
            worker,
            request.num_tokens - cached,
            request.num_tokens,
            now,
            request.priority,
        )
        if self.tracks_blocks and request.block_hashes:
            bit = self.members.bit[worker]
            held = self.index.depth(bit, request.block_hashes)
            self.pending.add(request.request_id, bit, request.block_hashes[held:], now)
        if adapter is not None:
            self.adapters.routed(worker, adapter)
        return decision

    def _to_holder(
        self, decision: RouteDecision, request: RouteRequest, adapter: str
    ) -> RouteDecision:
        """`decision` if its worker holds `adapter` (or nobody does: the worker refuses it by
        name), else the holder whose queued prefill frees up first."""
        holders = self.adapters.holders(adapter)
        if not holders or holders >> self.members.bit[decision.worker] & 1:
            return decision
        bit = next(bit for _, bit in self.loads.by_free if holders >> bit & 1)
        worker = self.members.by_bit[bit]
        assert worker is not None
        held = self.index.depth(bit, request.block_hashes) if self.tracks_blocks else 0
        return RouteDecision(worker, self.predicted_tokens(held, request))

    def route_burst(
        self, requests: Sequence[RouteRequest]
    ) -> list[tuple[RouteRequest, RouteDecision]]:
        """Route requests that arrived together; returns them in the order to dispatch them:
        here the order given (a policy that reorders overrides this)."""
        return [(request, self.route(request)) for request in requests]

    def choose(self, request: RouteRequest, now: float) -> RouteDecision:
        """The policy: pick a worker for `request` (there is at least one)."""
        raise NotImplementedError

    def prefill_done(self, worker: WorkerId, request_id: str) -> None:
        """The request's prompt is computed: its work leaves the worker's queue."""
        self.members.require(worker)
        now = self.clock()
        self.loads.prefill_done(request_id, now)
        self.pending.settle(request_id, now)

    def finished(self, worker: WorkerId, request_id: str) -> None:
        """The request is over: its KV occupancy is released. Unknown ids are ignored."""
        self.members.require(worker)
        now = self.clock()
        self.loads.finished(request_id, now)
        self.pending.settle(request_id, now)

    def calibrate(self, rates: ServiceRates) -> None:
        """Cost time with learned rates from now on (router/service_model.py): the prefill
        rate behind every wait and prefill in seconds, and the decode cost per running request
        where a policy counts it. Queued work keeps the seconds it was routed with until the
        worker's next `prefill_done` re-prices what is left of its queue."""
        self.prefill_rate = self.loads.prefill_rate = rates.prefill_rate
        self.decode_s = rates.decode_s
        if rates.host_rate is not None:
            self.host_rate = rates.host_rate
        if rates.disk_rate is not None:
            self.disk_rate = rates.disk_rate
        if rates.peer_rate is not None and self.peer_rate is not None:
            self.peer_rate = rates.peer_rate

    def report_load(self, worker: WorkerId, load: WorkerLoad) -> None:
        self.members.require(worker)
        self.loads.workers[worker].reported = load

    def report_adapters(self, worker: WorkerId, adapters: WorkerAdapters) -> None:
        """The adapters `worker` holds and has resident, and its swap seconds."""
        self.members.require(worker)
        self.adapters.report(worker, adapters)

    def deeper_holder(
        self, request: RouteRequest, worker: WorkerId, least: int = 1
    ) -> tuple[WorkerId, int] | None:
        """The worker other than `worker` whose device tier holds the most leading blocks of
        `request` (its host tier and saved cache do not count: a peer sends what its device
        holds), with the positions they cover, when that is at least `least` more than
        `worker` holds in any tier (its pending routes do not count: called once the request
        is routed, they include the request's own); None otherwise, and for a policy that
        tracks no blocks. The first such worker by membership order on a tie. A worker told to
        serve the request may read their KV from it rather than recompute them
        (worker/peer_reads.py)."""
        hashes = request.block_hashes
        if not self.tracks_blocks or not hashes:
            return None
        own = self.members.bit[worker]
        bit, deepest = self.deepest_on_device(hashes, own)
        if bit < 0:
            return None
        positions = self.predicted_tokens(deepest, request)
        held = self.predicted_tokens(self.index.depth(own, hashes), request)
        holder = self.members.by_bit[bit]
        return (holder, positions) if holder and positions - held >= least else None

    def deepest_on_device(self, hashes: tuple[int, ...], skip: int = -1) -> tuple[int, int]:
        """(bit, blocks) of the member, but `skip`'s, whose device holds the most leading blocks
        of `hashes` as its events say (in sync: not between a gap and its snapshot; pending
        routes do not count); (-1, 0) when none holds any. The first by membership on a tie."""
        index, best, deepest = self.index, -1, 0
        for bit, worker in enumerate(self.members.by_bit):
            if worker is None or bit == skip:
                continue
            depth = index.depth(bit, hashes)
            if depth > deepest and index.in_sync(worker):
                depth = index.host_from(bit, hashes, index.disk_from(bit, hashes, depth))
                if depth > deepest:
                    best, deepest = bit, depth
        return best, deepest

    # -- reports -------------------------------------------------------------------------------
    def index_bytes(self) -> int:
        """Bytes held by the block index and the pending routes (counted, not sampled)."""
        if not self.tracks_blocks:
            return 0
        return self.index.nbytes() + self.pending.nbytes()

    def predicted_tokens(self, blocks: int, request: RouteRequest) -> int:
        """Tokens a worker holding `blocks` leading blocks serves from cache (never the last
        prompt token: its logits are needed)."""
        return max(0, min(blocks * self.block_tokens, request.num_tokens - 1))
