"""cache_aware, the default policy: the worker where this request's time to first token, plus
what the choice costs later requests, is least. It must never wait for a KV event to learn
about its own routes (pending routes), nor count load only from completed responses.

For each candidate worker W, with `cached(W)` read from the exact block index plus pending
routes, and `best` the most any worker holds:

    cost(W) = wait(W)                          W's queued prefill, drained to now (router/load.py);
                                               under the workers' priority policy, the share of
                                               it of this request's priority or more urgent
            + (n - cached(W)) / rate           this request's own prefill there
            + beta * (best - cached(W)) / rate     prefill it redoes that another worker holds
            + reserved(W)                      the wait it imposes on later members of its burst
                                               whose only home is W
            + decode_s x running(W)            the engine steps of W's running requests that the
                                               new one waits through (0 unless `calibrate`d)
            + host(W) / host_rate              the part of cached(W) that W holds in its host
                                               tier, copied back before the prefill (only
                                               while some worker has one)
            + disk(W) / disk_rate              the part of cached(W) that only W's saved cache
                                               holds, read back before the prefill (only while
                                               some worker has one)
            + swap(W)                          a LoRA request on a worker where its adapter
                                               is not resident: the worker's swap seconds
                                               (router/adapters.py; 0 where resident)

With a `peer_rate` (RouterConfig, learned once configured), a worker holding at least
`peer_min_tokens` less than `read_to`, what the deepest device holder holds (the worker a
request is told to read from: `deeper_holder`), reads the difference r from it instead of
recomputing it (worker/peer_reads.py): its own prefill and work term then count r at
1 / peer_rate and beta / peer_rate instead of 1 / rate and beta / rate (the read, and the
second copy it makes). Only while the read is the faster way: a peer_rate at or below the
prefill rate changes nothing.

A LoRA request's candidates are the workers that hold its adapter (resident or in host
memory); the swap term gathers an adapter's requests where it is resident, and since the wait
still counts, a busy holder spills to one that must swap it in (not starving other adapters).

The first two terms are the request's own TTFT; the greedy `least_ttft` stops there. The third
is the cost to later requests of scattering a prefix: every token recomputed away from its
holder is prefill that later requests queue behind, and a second copy that evicts something
else. It lets a request wait for its holder up to (1 + beta) x the recompute that saves, never
longer; it is dropped (beta = 0) for a request whose best TTFT is already in the tail (at least
the `tail_quantile` of recent prefills), whose own latency then matters most. The fourth term
exists only inside a burst, where the later requests are known.

Bounded load: a worker whose wait exceeds (1 + epsilon) x the mean wait (this prefill
included) + `slack_s` is no candidate, so a hot prefix spills to another worker instead of
building one queue; the least loaded worker always qualifies. Ties, and prefixes nobody holds,
go by rendezvous hash of the first block nobody holds, so equal new prefixes meet. Bursts are
dispatched very long first, then shortest first (router/burst.py).

Candidates: every member of a small match group, the least loaded few of a large one, so a
decision costs O(log matched blocks + groups x scan), not O(workers). Once `calibrate`d with a
decode cost, a large group's members are looked at while their wait alone is under the best
cost seen, which can be all of its idle members. While some queue holds work at a priority
other than 0, or the request has one, the waits no longer follow the load book's order and
every member of every group is looked at (O(workers)); with every priority 0 (fcfs), nothing
changes.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Sequence
from operator import itemgetter

from router.base import BaseRouter, Clock
from router.burst import TailEstimate, shortest_first
from router.config import RouterConfig
from router.interface import RouteDecision, RouteRequest, WorkerId
from router.prefix_match import prefix_groups
from router.rendezvous import weight

_TAIL_SAMPLING = {"window": 512, "warmup": 16, "stride": 4}
"""The tails read every 4th decision of the last 2,048: the sorted inserts were a third of a
decision's time, and on the conversation trace the 97th percentile of 512 samples moved the
simulator's p50 TTFT by at most 0.004 s and its p99 by 0.06 s (docs/router.md)."""


class CacheAware(BaseRouter):
    name = "cache_aware"
    adapter_aware = True

    def __init__(
        self,
        config: RouterConfig | None = None,
        clock: Clock = time.monotonic,
        work_weight: float = 1.0,
        epsilon: float = 1.0,
        slack_s: float = 8.0,
        burst: bool = True,
        tail_quantile: float = 0.97,
        scan: int = 4,
        tail_free: bool = True,
        adapter_swaps: bool = True,
    ) -> None:
        """`work_weight`: beta above; `epsilon`, `slack_s`: the guard; `burst`: dispatch bursts
        in the order of router/burst.py (False: as given); `tail_quantile`: where the tail
        starts (very long burst members, no work term); `scan`: candidates looked at per large
        match group; `tail_free`: drop the work term for requests in the tail;
        `adapter_swaps`: price an adapter's swap into a slot (False: adapter-blind, the
        simulator's comparison; holders only either way)."""
        super().__init__(config, clock)
        if work_weight < 0 or epsilon < 0 or slack_s < 0 or scan < 1:
            raise ValueError(
                f"need work_weight, epsilon, slack_s >= 0 and scan >= 1, got {work_weight}, "
                f"{epsilon}, {slack_s}, {scan}"
            )
        self.work_weight = work_weight
        self.epsilon = epsilon
        self.slack_s = slack_s
        self.tail_free = tail_free
        self.burst = burst
        self.tail = TailEstimate(tail_quantile, **_TAIL_SAMPLING)
        """Where a burst's very long requests start: a quantile of predicted prefills."""
        self.ttft_tail = TailEstimate(tail_quantile, **_TAIL_SAMPLING)
        """Where the work term stops: the same quantile of requests' best TTFTs."""
        self.scan = scan
        self.adapter_swaps = adapter_swaps
        self._reserved: dict[WorkerId, list[float]] = {}

    # -- bursts --------------------------------------------------------------------------------
    def route_burst(
        self, requests: Sequence[RouteRequest]
    ) -> list[tuple[RouteRequest, RouteDecision]]:
        """Route requests that arrived together: very long first, then shortest first, each
        charged for the wait it would impose on a later member whose only home it takes."""
        if len(requests) < 2 or not self.burst:
            return super().route_burst(requests)
        views = [self._view(r) for r in requests]  # by position: ids may repeat
        order = shortest_first([own for own, _ in views], self.tail.value)
        reserved: dict[WorkerId, list[float]] = {}
        for _, home in views:
            if home is not None:
                reserved.setdefault(home[0], []).append(home[1])
        self._reserved = reserved
        routed = []
        try:
            for position in order:
                request, home = requests[position], views[position][1]
                if home is not None:
                    reserved[home[0]].remove(home[1])
                routed.append((request, self.route(request)))
        finally:
            self._reserved = {}
        return routed

    def _view(self, request: RouteRequest) -> tuple[float, tuple[WorkerId, float] | None]:
        """(prefill seconds on the best-matching worker, its home): the home is the one worker
        holding the longest prefix, with the seconds it saves over the next best; None when no
        single worker holds more than all others."""
        groups = prefix_groups(request.block_hashes, self.index.holders, self.pending.holders)
        if not groups:
            return request.num_tokens / self.prefill_rate, None
        rate, n = self.prefill_rate, request.num_tokens
        holders, depth = groups[-1]
        best = self.predicted_tokens(depth, request)
        if holders & (holders - 1):
            return (n - best) / rate, None
        worker = self.members.by_bit[holders.bit_length() - 1]
        assert worker is not None
        runner_up = self.predicted_tokens(groups[-2][1], request) if len(groups) > 1 else 0
        return (n - best) / rate, (worker, (best - runner_up) / rate)

    # -- the policy ----------------------------------------------------------------------------
    def choose(self, request: RouteRequest, now: float) -> RouteDecision:
        groups = prefix_groups(request.block_hashes, self.index.holders, self.pending.holders)
        rate, n = self.prefill_rate, request.num_tokens
        best_cached = self.predicted_tokens(groups[-1][1], request) if groups else 0
        self.tail.add((n - best_cached) / rate)
        candidates, best_ttft = self._candidates(request, groups, now)
        extra = self.work_weight / rate
        if self.tail_free:
            ttft_tail = self.ttft_tail
            if best_ttft >= ttft_tail.value:
                extra = 0.0  # its TTFT is in the tail wherever it goes: only its own counts
            ttft_tail.add(best_ttft)
        reads = self._priced_reads(request, candidates, extra)  # off: nothing more a candidate
        reserved_of, decode_s, states = self._reserved, self.decode_s, self.loads.workers
        tiers = self.index.host_holders or self.index.disk_holders
        adapter = request.namespace.adapter if self.adapter_swaps else None
        swap_s = self.adapters.swap_s
        low = float("inf")
        tied: list[tuple[WorkerId, int]] = []  # not list[...](): a generic alias per call
        for worker, wait, own, cached in candidates:
            cost = wait + own + extra * (best_cached - cached)
            if decode_s:
                cost += decode_s * states[worker].running
            if tiers and cached:
                cost += self._tier_seconds(worker, request.block_hashes, cached)
            if adapter is not None:
                cost += swap_s(worker, adapter)
            if reserved_of:
                for saving in reserved_of.get(worker, ()):
                    cost += own if own < saving else saving
            if cost < low - 1e-9:
                low, tied = cost, [(worker, cached)]
            elif cost <= low + 1e-9:
                tied.append((worker, cached))
        return self._decided(tied, request.block_hashes, groups, reads)

    def _priced_reads(
        self,
        request: RouteRequest,
        candidates: list[tuple[WorkerId, float, float, int]],
        extra: float,
    ) -> dict[WorkerId, int] | None:
        """Price a read from a peer into each candidate's cost (in place, added to its wait:
        its `own` stays the recompute that a burst's reservations compare), and return
        the tokens each would read: those between what it holds and what the deepest in-sync
        device holder holds (the worker `deeper_holder` names; pending routes and host or
        disk blocks count toward `best` but are never read), when at least `peer_min_tokens`,
        at 1 / peer_rate for the prefill and beta / peer_rate for the work term instead of
        1 / rate and beta / rate. None while a read is not priced or not the faster way
        (peer_rate at or under the prefill rate)."""
        peer, rate = self.peer_rate, self.prefill_rate
        if peer is None or peer <= rate:
            return None
        read_k = (extra * rate / peer - extra) - (1.0 / rate - 1.0 / peer)
        read_to = self.predicted_tokens(self.deepest_on_device(request.block_hashes)[1], request)
        least, reads = self.config.peer_min_tokens, {}
        for i, (worker, wait, own, cached) in enumerate(candidates):
            read = read_to - cached
            if read >= least:
                reads[worker] = read
                candidates[i] = (worker, wait + read_k * read, own, cached)
        return reads

    def _decided(
        self,
        tied: list[tuple[WorkerId, int]],
        hashes: tuple[int, ...],
        groups: list[tuple[int, int]],
        reads: dict[WorkerId, int] | None,
    ) -> RouteDecision:
        """The one of `tied` (`_pick` among several), predicted to serve from cache what it
        holds and what it reads."""
        decision = RouteDecision(*tied[0]) if len(tied) == 1 else self._pick(tied, hashes, groups)
        read = reads.get(decision.worker, 0) if reads else 0
        return (
            RouteDecision(decision.worker, decision.predicted_cached_tokens + read)
            if read
            else decision
        )

    def _candidates(
        self, request: RouteRequest, groups: list[tuple[int, int]], now: float
    ) -> tuple[list[tuple[WorkerId, float, float, int]], float]:
        """(worker, wait s, own prefill s, cached tokens) of up to `scan` least loaded members
        of each match group (and of the workers matching nothing) under the load guard, and
        the least wait + own prefill among them (the request's best TTFT)."""
        members, loads, rate, n = self.members, self.loads, self.prefill_rate, request.num_tokens
        block, last = self.block_tokens, n - 1 if n else 0
        allowed = self._allowed(request)
        rest = allowed
        for mask, _ in groups:
            rest &= ~mask
        matched = [(mask & allowed, min(depth * block, last)) for mask, depth in groups]
        matched = [(mask, cached) for mask, cached in matched if mask]
        if rest:
            matched.append((rest, 0))
        # the guard cannot bind while no worker waits longer than the slack
        guarded = loads.by_free[-1][0] - now > self.slack_s
        waiting = self._total_wait(now) if guarded else 0.0
        bound = float("inf")
        states, by_bit, scan = loads.workers, members.by_bit, self.scan
        # with priorities in the queues (or an urgent request), a worker's wait is the share of
        # its queue ahead of this request: no longer in `by_free` order, so every member is
        # looked at
        priority = request.priority
        ranked = not (priority < 0 or loads.prioritized)
        out: list[tuple[WorkerId, float, float, int]] = []
        best_ttft = float("inf")
        for mask, cached in matched:
            own = (n - cached) / rate
            if guarded:
                bound = self._bound(waiting, own)
            if ranked and mask.bit_count() > scan:
                least = len(out)
                self._least_loaded(out, mask, own, cached, bound, now)
                if len(out) > least:
                    best_ttft = min(best_ttft, out[least][1] + own)
                continue
            left = mask
            while left:  # a small group: look at each member
                low = left & -left
                left ^= low
                worker = by_bit[low.bit_length() - 1]
                assert worker is not None
                state = states[worker]
                free_at = state.free_at
                wait = free_at - now if free_at > now else 0.0
                if not ranked and wait:
                    wait *= loads.ahead(state, priority)
                if wait <= bound:
                    out.append((worker, wait, own, cached))
                    best_ttft = min(best_ttft, wait + own)
        return out, best_ttft

    def _allowed(self, request: RouteRequest) -> int:
        """The workers that may serve `request`: for a LoRA request, those holding its adapter
        (every worker when none does: the chosen one refuses it by name)."""
        adapter = request.namespace.adapter
        holders = self.adapters.holders(adapter) if adapter is not None else 0
        return holders or self.members.all_mask

    def _least_loaded(
        self,
        out: list[tuple[WorkerId, float, float, int]],
        mask: int,
        own: float,
        cached: int,
        bound: float,
        now: float,
    ) -> None:
        """Appends to `out` the members of a large group in `free_at` order, under `bound`:
        the least loaded, those tied with it, and any before the first one no burst member has
        reserved (at most `scan`). Within a group only the wait and reservations differ, so no
        later member can cost less; once `calibrate`d the running requests differ too (the
        longest idle workers are often those with the most requests decoding), so the scan
        goes on, past `scan`, while a member's wait, the floor of its cost, is under the least
        cost of an unreserved member seen."""
        by_bit, reserved = self.members.by_bit, self._reserved
        decode_s, states = self.decode_s, self.loads.workers
        first = len(out)
        full = first + self.scan if not decode_s else -1  # len(out) once `scan` are in
        floor = float("inf")  # the least cost of an unreserved member so far
        for free_at, bit in self.loads.by_free:
            if not mask >> bit & 1:
                continue
            wait = free_at - now if free_at > now else 0.0
            if wait > bound or wait > floor + 1e-9:
                break
            worker = by_bit[bit]
            assert worker is not None
            out.append((worker, wait, own, cached))
            if worker not in reserved:
                cost = wait + decode_s * states[worker].running if decode_s else out[first][1]
                floor = min(floor, cost)
            if len(out) == full:
                break

    def _tier_seconds(self, worker: WorkerId, hashes: tuple[int, ...], cached: int) -> float:
        """Seconds to bring back the `cached` leading tokens `worker` holds outside its device:
        those in its host tier at `host_rate`, those only its disk holds at `disk_rate` (its
        blocks on the chain: device, host, then disk alone)."""
        block, index, bit = self.block_tokens, self.index, self.members.bit[worker]
        depth = min(-(-cached // block), len(hashes))
        disk_start = index.disk_from(bit, hashes, depth) if index.disk_holders else depth
        host_start = index.host_from(bit, hashes, disk_start) if index.host_holders else disk_start
        disk = max(0, cached - disk_start * block)
        host = max(0, min(cached, disk_start * block) - host_start * block)
        # a worker recomputes what it would read slower (worker/tier_costs.py)
        return host / self.host_rate + disk / max(self.disk_rate, self.prefill_rate)

    def _total_wait(self, now: float) -> float:
        """Seconds of queued prefill on all workers together, drained to `now`."""
        by_free = self.loads.by_free
        busy = by_free[bisect_right(by_free, (now, -1)) :]
        return sum(map(itemgetter(0), busy)) - now * len(busy)

    def _bound(self, waiting: float, own: float) -> float:
        """The load guard: the longest wait a candidate may have, in seconds: (1 + epsilon) x
        the mean wait once this prefill is queued, + slack. The least loaded worker always
        passes (its wait is at most the mean)."""
        mean = (waiting + own) / len(self.loads.workers)
        return (1 + self.epsilon) * mean + self.slack_s

    def _pick(
        self,
        tied: list[tuple[WorkerId, int]],
        hashes: tuple[int, ...],
        groups: list[tuple[int, int]],
    ) -> RouteDecision:
        """Among equal costs, the rendezvous winner for the first block nobody holds."""
        deepest = groups[-1][1] if groups else 0
        key = hashes[min(deepest, len(hashes) - 1)] if hashes else 0
        seeds = self.members.seed
        heaviest = max([(weight(key, seeds[worker]), worker, cached) for worker, cached in tied])
        return RouteDecision(heaviest[1], heaviest[2])
