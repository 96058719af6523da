"""Trace-driven discrete-event simulation of routing policies over N workers with real caches.

Each simulated worker owns a real `cache.SequenceCache` (page pool + radix tree) of the given
capacity, and the reference service model, so that numbers compare across implementations:

- a worker prefills one request at a time, first come first served, at `--prefill-rate`
  tokens/s over the prompt tokens its cache does not hold when the prefill starts;
- TTFT = time waiting for the worker + uncached tokens / rate;
- the prompt enters the worker's cache when its prefill completes (KV events go to the router
  then, `--event-delay-ms` later); decode is not modelled;
- tiers (`--host-tokens`): each worker's cache also has a host tier of that many tokens; what
  its device evicts moves there, and a request whose prefix it reaches copies it back at
  `--host-rate` tokens/s before its prefill (TTFT adds host tokens / host rate). The router is
  told that rate (a live router learns it).

- batch work (`--batch-share F`): a seeded share F of the requests is at priority 1; each
  worker then admits by priority (first come, first served within one) and an urgent arrival
  preempts a less urgent prefill, which resumes with what it had left (a worker's chunked
  prefill under the `priority` policy gives an urgent request the next step). The report adds
  TTFT per class, and a `cache_aware-priority_blind` run that routes every request as if at
  priority 0.

- LoRA adapters (`--workload lora-zipf`: Zipf over `--adapters` adapters, each with its own
  system prompts): each worker holds every adapter in host memory and `--max-loras` of them
  in device slots (least recently used leaves); a prefill whose adapter is not in a slot first
  swaps it in, `--swap-ms` added to its TTFT. Workers report their slots to the router as a
  live worker's Load does, `--event-delay-ms` later. The adapter-blind run is cache_aware
  with its swap term off (`cache_aware-adapter_blind`).

References on the same stream: the pooled cache (one cache of N x capacity, each request served
at its arrival) and the TTFT floor (uncached tokens of the pooled cache / rate, no queueing).

Mooncake traces (`--trace`) are expanded with benchmarks.workloads: equal hash ids give equal
512-token blocks. Every cache position stands for `--token-scale` tokens (16: a 512-token block
is 32 positions), page size 1, routing blocks of one trace block (512 tokens); all reported
token counts and times are in trace tokens. `--copies K` replays K copies of the trace at once,
each in its own tenant namespace (arrival rate x K), for runs with many workers.

Prints one JSON object per policy on stdout (also to --output), a summary table on stderr.
Run: `python benchmarks/router_sim.py [--trace PATH | --workload NAME] [--policy NAME]`.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import itertools
import json
import random
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from benchmarks import workloads
from benchmarks.workloads import MOONCAKE_BLOCK
from cache import (
    BlockHasher,
    CacheConfig,
    CachedSequence,
    CacheNamespace,
    IdentityScheme,
    KvEvent,
    KvEventKind,
    OutOfPages,
    SequenceCache,
)
from cluster.progress import progress_bar
from router.adapters import WorkerAdapters
from router.config import RouterConfig, default_host_rate
from router.interface import RouteDecision, RouteRequest, RoutingPolicy
from router.policies import POLICIES, make_policy

console = Console(stderr=True)
WINDOW_S = 60.0


@dataclass(slots=True)
class SimRequest:
    """One request as every policy sees it (positions: cache units of `token_scale` tokens)."""

    rid: str
    arrival_s: float
    positions: tuple[int, ...]
    namespace: CacheNamespace
    route: RouteRequest


@dataclass
class Stream:
    requests: list[SimRequest]
    token_scale: int
    block_positions: int
    source: str


@dataclass
class SimWorker:
    name: str
    cache: SequenceCache
    queue: list[tuple[int, int, int]] = field(default_factory=list)
    """(priority, order queued, request index), a heap: first come, first served within a
    priority, as the workers' `priority` policy admits (fcfs: every priority 0)."""
    until: float = 0.0
    """When the prefill running ends."""
    running: tuple[int, int] = (0, 0)
    """The running prefill's (priority, order queued)."""
    epoch: int = 0
    """Counts preemptions: an end scheduled before the last one is stale."""
    paused: dict[int, tuple[CachedSequence | None, float]] = field(default_factory=dict)
    """Request index -> its sequence and the seconds of prefill it has left, once preempted."""
    busy: tuple[int, CachedSequence | None] | None = None
    work_tokens: int = 0
    slots: OrderedDict[str, None] = field(default_factory=OrderedDict)
    """LoRA adapters (identities) in device slots, least recently used first."""
    swaps: int = 0


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the request stream ------------------------------------------------------------------------
def load_stream(args: argparse.Namespace) -> Stream:
    if args.workload:
        return synthetic_stream(args)
    scale = args.token_scale
    if scale < 1 or MOONCAKE_BLOCK % scale:
        raise SystemExit(f"--token-scale {scale} must divide the trace's {MOONCAKE_BLOCK}-blocks")
    block = MOONCAKE_BLOCK // scale
    raw = workloads.mooncake(args.trace, block_tokens=block, limit=args.limit, seed=args.seed)
    base = [(r.arrival_ms / 1000.0, r.prompt) for r in raw]
    tenants = [None] if args.copies == 1 else [f"copy{k}" for k in range(args.copies)]
    items = [(t, p, tenant) for tenant in tenants for t, p in base]
    items.sort(key=lambda item: item[0])
    return Stream(_requests(items, block, scale), scale, block, str(args.trace.name))


def synthetic_stream(args: argparse.Namespace) -> Stream:
    """A seeded synthetic workload with Poisson arrivals at `--load` of the cluster's
    cold prefill capacity (1 position = 1 token, routing blocks of 16 tokens)."""
    make = cast(Callable[..., list[workloads.Request]], workloads.SYNTHETIC[args.workload])
    sizes = {"conversations": args.limit} if args.workload == "multi-turn" and args.limit else {}
    if args.limit and args.workload != "multi-turn":
        sizes = {"n": args.limit}
    if args.workload == "lora-zipf":
        sizes |= {"adapters": args.adapters, "zipf": args.adapter_zipf}
    raw = make(args.seed, **sizes)
    rng = random.Random(args.seed)
    mean_len = sum(len(r.prompt) for r in raw) / max(1, len(raw))
    rate = args.load * args.workers * args.prefill_rate / mean_len
    t, items = 0.0, []
    for r in raw:
        t += rng.expovariate(rate)
        items.append((t, r.prompt, r.tenant, r.adapter))
    return Stream(_requests(items, 16, 1), 1, 16, args.workload)


def adapter_identity(name: str) -> str:
    """A simulated adapter's cache identity (a live one is name@digest of its weights)."""
    return f"{name}@sim"


def _requests(
    items: Iterable[
        tuple[float, list[int], str | None] | tuple[float, list[int], str | None, str | None]
    ],
    block: int,
    scale: int,
) -> list[SimRequest]:
    hasher = BlockHasher(IdentityScheme(block, ""))
    namespaces: dict[tuple[str | None, str | None], CacheNamespace] = {}
    shared: dict[int, tuple[int, ...]] = {}  # copies of the trace share their prompts' tuples
    out = []
    for i, (arrival, prompt, tenant, *rest) in enumerate(items):
        adapter = rest[0] if rest else None
        ns = namespaces.setdefault(
            (tenant, adapter),
            CacheNamespace(adapter=adapter_identity(adapter) if adapter else None, tenant=tenant),
        )
        positions = shared.setdefault(id(prompt), tuple(prompt))
        hashes = tuple(hasher.hashes(positions, ns))
        rid = str(i)
        route = RouteRequest(rid, ns, hashes, len(positions) * scale)
        out.append(SimRequest(rid, arrival, positions, ns, route))
    return out


def batch_priorities(count: int, share: float, seed: int) -> list[int]:
    """1 for about `share` of `count` requests, drawn with `seed` (batch work), else 0."""
    if not share:
        return [0] * count
    draw = random.Random(f"batch-{seed}").random
    return [1 if draw() < share else 0 for _ in range(count)]


# -- one policy over the stream ----------------------------------------------------------------
ABLATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "least_ttft+burst_order": ("least_ttft", {"burst": True}),
    "cache_aware-in_arrival_order": ("cache_aware", {"burst": False}),
}
ADAPTER_BLIND = ("cache_aware-adapter_blind", "cache_aware", {"adapter_swaps": False})
PRIORITY_BLIND = ("cache_aware-priority_blind", "cache_aware", {})
"""The run `--batch-share` adds: cache_aware routing every request as if at priority 0 (the
workers still admit by priority), as before decision 84."""
"""The run a LoRA workload adds: cache_aware without its swap term (holders only still)."""
"""Rows of `--ablations`: what the burst dispatch order alone is worth, with and without the
rest of cache_aware's score."""
PEER_READS: tuple[str, str, dict[str, Any]] = ("cache_aware+peer_reads", "cache_aware", {})
"""The run `--peer-rate` adds: workers read the prefix from the worker the router names
(`deeper_holder`), the policy still prices a move as a recompute (what serving does with
`router.peer_kv_rate` 0)."""
PEER_PRICED: tuple[str, str, dict[str, Any]] = ("cache_aware+peer_priced", "cache_aware", {})
"""The other run `--peer-rate` adds: the same reads, and cache_aware prices a move as the read
(RouterConfig.peer_rate: `router.peer_kv_rate`)."""


class Simulation:
    def __init__(
        self,
        stream: Stream,
        policy_name: str,
        args: argparse.Namespace,
        knobs: dict[str, Any] | None = None,
        label: str | None = None,
        priority_blind: bool = False,
        peer_reads: bool = False,
        peer_priced: bool = False,
    ) -> None:
        self.stream = stream
        self.args = args
        self.scale = stream.token_scale
        self.rate = args.prefill_rate
        self.now = 0.0
        self.host_rate = args.host_rate or default_host_rate(self.rate)
        self.peer_rate = args.peer_rate if peer_reads else 0.0
        """Tokens/s a worker reads a prefix from the worker the router names (0: no reads)."""
        self.hints: dict[int, tuple[str, int]] = {}
        """Request index -> the worker named to read its prefix from, and what it holds."""
        self.peer_read = 0
        config = RouterConfig(
            prefill_rate=self.rate,
            block_tokens=stream.block_positions * self.scale,
            host_rate=self.host_rate,
            peer_rate=args.peer_rate if peer_priced else None,
            peer_min_tokens=max(1, args.peer_min_tokens),
        )
        self.policy: RoutingPolicy = make_policy(
            policy_name, config, lambda: self.now, **(knobs or {})
        )
        self.label = label or policy_name
        positions = args.capacity_tokens // self.scale
        host_positions = args.host_tokens // self.scale
        self.workers: dict[str, SimWorker] = {}
        self.deliveries: deque[tuple[float, str, KvEvent]] = deque()
        for w in range(args.workers):
            name = f"w{w}" if not args.seed else f"w{w}.{args.seed}"  # the seed salts tie-breaks
            cache = SequenceCache(
                CacheConfig(
                    positions + 1,
                    1,
                    max_sequences=4,
                    block_size=stream.block_positions,
                    host_pages=host_positions + 1 if host_positions else 0,
                ),
                source=name,
            )
            cache.events.subscribe(self._publisher(name))
            self.workers[name] = SimWorker(name, cache)
            self.policy.add_worker(name, args.capacity_tokens)
        self.swap_s = args.swap_ms / 1000.0
        self.adapters = sorted(
            {r.namespace.adapter for r in stream.requests if r.namespace.adapter is not None}
        )
        self.reports: deque[tuple[float, str, WorkerAdapters]] = deque()
        for name in self.workers:
            self._report_slots(self.workers[name], delay=0.0)
        self._deliver(0.0)
        self.heap: list[tuple[float, int, str, int]] = []
        self.priorities = batch_priorities(len(stream.requests), args.batch_share, args.seed)
        """Each request's priority: 1 for the `--batch-share` drawn as batch work, else 0."""
        self.routes = [
            replace(r.route, priority=p) if p and not priority_blind else r.route
            for r, p in zip(stream.requests, self.priorities, strict=True)
        ]
        self.queued = itertools.count()
        self.ttft_priority: list[int] = []
        self.ttft_at: dict[int, int] = {}
        """Request index -> its place in `ttft` (a preempted prefill's is rewritten later)."""
        self.preempts = bool(args.batch_share)
        """Batch work in the stream: an urgent arrival preempts a less urgent prefill, as the
        workers' chunked prefill under the priority policy gives it the next step."""
        self.route_ns: list[int] = []
        self._time_each_route()
        self.ttft: list[float] = []
        self.reused = self.total = self.host_reused = 0
        self.predicted_error = 0
        self.predicted: dict[str, int] = {}
        self.uncacheable = 0
        self.windows: dict[int, list[Any]] = {}
        """60 s window -> [prefills started, {worker: prefill tokens}]."""
        self.peak_index_bytes = 0

    def _time_each_route(self) -> None:
        """Shadow the policy's `route` with a timed call (route_burst calls self.route)."""
        inner, timings, clock = self.policy.route, self.route_ns, time.perf_counter_ns

        def timed(request: RouteRequest) -> RouteDecision:
            t0 = clock()
            decision = inner(request)
            timings.append(clock() - t0)
            return decision

        self.policy.route = timed  # type: ignore[method-assign]

    def _publisher(self, name: str) -> Callable[[KvEvent], None]:
        delay = self.args.event_delay_ms / 1000.0

        def deliver(event: KvEvent) -> None:
            self.deliveries.append((self.now + delay, name, event))

        return deliver

    def _deliver(self, until: float) -> None:
        deliveries, policy = self.deliveries, self.policy
        while deliveries and deliveries[0][0] <= until:
            _, name, event = deliveries.popleft()
            if not policy.apply_event(name, event):
                policy.load_snapshot(name, self.workers[name].cache.tree.snapshot())
        reports = self.reports
        while reports and reports[0][0] <= until:
            _, name, report = reports.popleft()
            policy.report_adapters(name, report)

    def _report_slots(self, worker: SimWorker, delay: float | None = None) -> None:
        """The worker's adapters as its Load reports them, `delay` (the event delay) later."""
        if not self.adapters:
            return
        delay = self.args.event_delay_ms / 1000.0 if delay is None else delay
        report = WorkerAdapters.of(self.adapters, tuple(worker.slots), self.swap_s)
        self.reports.append((self.now + delay, worker.name, report))

    def _swap_in(self, worker: SimWorker, adapter: str | None) -> float:
        """Seconds before the prefill can start: the adapter's swap into a slot, if needed."""
        if adapter is None:
            return 0.0
        if adapter in worker.slots:
            worker.slots.move_to_end(adapter)
            return 0.0
        worker.slots[adapter] = None
        if len(worker.slots) > self.args.max_loras:
            worker.slots.popitem(last=False)
        worker.swaps += 1
        self._report_slots(worker)
        return self.swap_s

    def run(self, progress: Progress | None = None, task: object = None) -> None:
        requests, heap = self.stream.requests, self.heap
        i, count, sampled = 0, len(requests), 0
        while i < count:
            arrival = requests[i].arrival_s
            burst = i + 1
            while burst < count and requests[burst].arrival_s == arrival:
                burst += 1
            while heap and heap[0][0] <= arrival:
                self._advance(heapq.heappop(heap))
            self.now = arrival
            self._deliver(arrival)
            self._arrive(range(i, burst))
            i = burst
            if progress is not None:
                progress.update(task, completed=i)  # type: ignore[arg-type]
            if i >= sampled:
                sampled = i + 2000
                self.peak_index_bytes = max(self.peak_index_bytes, self.policy.index_bytes())
        while heap:
            self._advance(heapq.heappop(heap))
        self.peak_index_bytes = max(self.peak_index_bytes, self.policy.index_bytes())

    def _advance(self, item: tuple[float, int, str, int]) -> None:
        worker = self.workers[item[2]]
        if item[3] != worker.epoch:  # a preempted prefill's end: it was rescheduled
            return
        self.now = item[0]
        self._deliver(self.now)
        self._finish(worker)

    def _arrive(self, burst: range) -> None:
        """Requests arriving at one instant go to the router together (`route_burst`)."""
        routes, timings = self.routes, self.route_ns
        first = len(timings)
        t0 = time.perf_counter_ns()
        routed = self.policy.route_burst([routes[i] for i in burst])
        total = time.perf_counter_ns() - t0
        share = (total - sum(timings[first:])) // len(burst)  # ordering, spread evenly
        for k in range(first, len(timings)):
            timings[k] += share
        for request, decision in routed:
            self.predicted[request.request_id] = decision.predicted_cached_tokens
            worker = self.workers[decision.worker]
            i = int(request.request_id)
            if self.peer_rate:  # as the router service names a kv_peer
                least = self.args.peer_min_tokens
                hint = self.policy.deeper_holder(request, decision.worker, least)
                if hint is not None:
                    self.hints[i] = hint
            heapq.heappush(worker.queue, (self.priorities[i], next(self.queued), i))
            if worker.busy is None:
                self._start(worker)
            elif self.preempts and worker.queue[0][0] < worker.running[0]:
                self._preempt(worker)

    def _preempt(self, worker: SimWorker) -> None:
        """Put the running prefill back in the queue, with what it has left, and start the more
        urgent one."""
        assert worker.busy is not None
        i, seq = worker.busy
        worker.paused[i] = (seq, max(0.0, worker.until - self.now))
        heapq.heappush(worker.queue, (*worker.running, i))
        worker.busy = None
        worker.epoch += 1
        self._start(worker)

    def _start(self, worker: SimWorker) -> None:
        priority, order, i = heapq.heappop(worker.queue)
        worker.running = (priority, order)
        req = self.stream.requests[i]
        if i in worker.paused:  # resumed: the rest of its prefill
            seq, left = worker.paused.pop(i)
            worker.busy, worker.until = (i, seq), self.now + left
            self.ttft[self.ttft_at[i]] = worker.until - req.arrival_s
            heapq.heappush(self.heap, (worker.until, i, worker.name, worker.epoch))
            return
        n = len(req.positions)
        try:
            seq: CachedSequence | None = worker.cache.start(req.positions, req.namespace)
        except OutOfPages:  # a prompt longer than the whole cache: served, never cached
            seq = None
            self.uncacheable += 1
        reused = seq.reused if seq is not None else 0
        host = seq.host_reused if seq is not None else 0
        if seq is not None:
            worker.cache.take_page_copies(seq)  # tier copies: their time is charged below
        read = self._peer_read(i, req, reused) if self.peer_rate else 0
        uncached = (n - reused - read) * self.scale
        duration = uncached / self.rate + host * self.scale / self.host_rate
        if read:
            duration += read * self.scale / self.peer_rate
            self.peer_read += read
        duration += self._swap_in(worker, req.namespace.adapter)
        self.host_reused += host
        self.ttft_at[i] = len(self.ttft)
        self.ttft.append(self.now - req.arrival_s + duration)
        self.ttft_priority.append(self.priorities[i])
        self.reused += reused
        self.total += n
        self.predicted_error += abs(self.predicted.pop(req.rid) - (reused + read) * self.scale)
        worker.work_tokens += uncached
        window = self.windows.setdefault(int(self.now // WINDOW_S), [0, {}])
        window[0] += 1
        window[1][worker.name] = window[1].get(worker.name, 0) + uncached
        worker.busy, worker.until = (i, seq), self.now + duration
        heapq.heappush(self.heap, (worker.until, i, worker.name, worker.epoch))

    def _peer_read(self, i: int, req: SimRequest, reused: int) -> int:
        """Positions of request `i` its worker reads from the worker named for it, past the
        `reused` it holds: what that worker's device holds now (as the router's index said, at
        most), when at least `--peer-min-tokens` (worker/peer_reads.py, without its pricing:
        the simulated read is always the faster way)."""
        hint = self.hints.pop(i, None)
        if hint is None:
            return 0
        match = self.workers[hint[0]].cache.tree.match(req.positions, req.namespace)
        held = min(match.length, hint[1] // self.scale, len(req.positions) - 1)
        read = held - reused
        return read if read * self.scale >= self.args.peer_min_tokens else 0

    def _finish(self, worker: SimWorker) -> None:
        assert worker.busy is not None
        i, seq = worker.busy
        worker.busy = None
        if seq is not None:
            worker.cache.finish(seq, len(seq.keys))  # the prompt enters the cache
        rid = self.stream.requests[i].rid
        self.policy.prefill_done(worker.name, rid)
        self.policy.finished(worker.name, rid)
        if worker.queue:
            self._start(worker)

    def result(self, pooled: dict[str, float], wall_s: float) -> dict[str, Any]:
        work = [w.work_tokens for w in self.workers.values()]
        mean = sum(work) / len(work)
        window_ratios = []
        for count, per_worker in self.windows.values():
            total = sum(per_worker.values())
            if total and count >= len(work):  # windows with at least one prefill per worker
                window_ratios.append(max(per_worker.values()) * len(work) / total)
        routing_s = sum(self.route_ns) / 1e9
        hit = self.reused / max(1, self.total)
        stored_blocks = sum(len(w.cache.tree.block_set()) for w in self.workers.values())
        tiers: dict[str, Any] = {}
        if self.adapters:
            tiers["adapters"] = len(self.adapters)
            tiers["max_loras"] = self.args.max_loras
            tiers["swap_ms"] = self.args.swap_ms
            tiers["adapter_swaps"] = sum(w.swaps for w in self.workers.values())
        if self.args.host_tokens:  # (absent without tiers: the pinned output stays as it was)
            tiers = {
                "host_tokens": self.args.host_tokens,
                "host_rate": self.host_rate,
                "host_hit_rate": self.host_reused / max(1, self.total),
            }
        if self.peer_rate:  # (absent without reads, as the tiers')
            tiers |= {
                "peer_rate": self.peer_rate,
                "peer_read_rate": self.peer_read / max(1, self.total),
                "hit_rate_with_reads": (self.reused + self.peer_read) / max(1, self.total),
            }
        if self.args.batch_share:  # (absent without batch work, as the tiers')
            tiers |= {"batch_share": self.args.batch_share}
            for name, level in (("interactive", 0), ("batch", 1)):
                mine = [t for t, p in zip(self.ttft, self.ttft_priority, strict=True) if p == level]
                tiers[f"{name}_requests"] = len(mine)
                for q in (0.5, 0.9, 0.99):
                    tiers[f"{name}_ttft_p{int(q * 100)}_s"] = _percentile(mine, q)
        return tiers | {
            "policy": self.label,
            "source": self.stream.source,
            "workers": len(self.workers),
            "capacity_tokens": self.args.capacity_tokens,
            "prefill_rate": self.rate,
            "requests": len(self.ttft),
            "hit_rate": hit,
            "pooled_hit_rate": pooled["hit_rate"],
            "fraction_of_pooled": hit / pooled["hit_rate"] if pooled["hit_rate"] else 0.0,
            "imbalance": max(work) / mean if mean else 0.0,
            "window_imbalance_max": max(window_ratios, default=0.0),
            "ttft_mean_s": sum(self.ttft) / max(1, len(self.ttft)),
            "ttft_p50_s": _percentile(self.ttft, 0.5),
            "ttft_p90_s": _percentile(self.ttft, 0.9),
            "ttft_p99_s": _percentile(self.ttft, 0.99),
            "ttft_floor_p50_s": pooled["ttft_floor_p50_s"],
            "ttft_floor_p99_s": pooled["ttft_floor_p99_s"],
            "decisions_per_s": len(self.route_ns) / routing_s if routing_s else 0.0,
            "decision_p50_us": _percentile(self.route_ns, 0.5) / 1000.0,  # type: ignore[arg-type]
            "decision_p99_us": _percentile(self.route_ns, 0.99) / 1000.0,  # type: ignore[arg-type]
            "index_bytes": self.peak_index_bytes,
            "index_bytes_per_block": self.peak_index_bytes / max(1, stored_blocks),
            "prediction_error_tokens_mean": self.predicted_error / max(1, len(self.ttft)),
            "uncacheable_requests": self.uncacheable,
            "pooled_finished_early": pooled["pooled_finished_early"],
            "token_scale": self.scale,
            "event_delay_ms": self.args.event_delay_ms,
            "seed": self.args.seed,
            "wall_s": wall_s,
        }


# -- the references ----------------------------------------------------------------------------
def pooled_reference(stream: Stream, args: argparse.Namespace) -> dict[str, float]:
    """One cache of N x capacity; every request served at its arrival, inserted when done.

    Should the live sequences' pages ever fill the whole pool (tiny pools only), the one that
    would finish first is finished early to make room, and counted."""
    scale, rate = stream.token_scale, args.prefill_rate
    positions = args.workers * args.capacity_tokens // scale
    cache = SequenceCache(
        CacheConfig(positions + 1, 1, max_sequences=65536, block_size=stream.block_positions)
    )
    running: list[tuple[float, int, CachedSequence]] = []
    floor: list[float] = []
    reused = total = forced = 0
    for i, req in enumerate(stream.requests):
        while running and running[0][0] <= req.arrival_s:
            _, _, done = heapq.heappop(running)
            cache.finish(done, len(done.keys))
        while True:
            try:
                seq = cache.start(req.positions, req.namespace)
                break
            except OutOfPages:  # live sequences lock the whole pool: end the earliest now
                if not running:
                    raise
                _, _, done = heapq.heappop(running)
                cache.finish(done, len(done.keys))
                forced += 1
        n = len(req.positions)
        reused += seq.reused
        total += n
        duration = (n - seq.reused) * scale / rate
        floor.append(duration)
        heapq.heappush(running, (req.arrival_s + duration, i, seq))
    return {
        "hit_rate": reused / max(1, total),
        "ttft_floor_p50_s": _percentile(floor, 0.5),
        "ttft_floor_p99_s": _percentile(floor, 0.99),
        "pooled_finished_early": forced,
    }


# -- the decision-rate measurement -------------------------------------------------------------
def decision_rate(args: argparse.Namespace) -> dict[str, Any]:
    """Time `route` alone over `--decisions` requests of `--prompt-tokens` tokens: half
    continue a conversation seen before (its prefix, a new last block), half start a new one.
    After each route the chosen worker stores the request's blocks (a `stored` event) and
    finishes it, so the indexes grow as they would in service."""
    if not 1 <= args.block_tokens <= args.prompt_tokens:
        raise SystemExit(
            f"need 1 <= --block-tokens <= --prompt-tokens, got {args.block_tokens}, "
            f"{args.prompt_tokens}"
        )
    rng = random.Random(args.seed)
    block, blocks = args.block_tokens, args.prompt_tokens // args.block_tokens
    hasher = BlockHasher(IdentityScheme(1, ""))  # one key per routing block
    ns = CacheNamespace()
    now = [0.0]
    config = RouterConfig(prefill_rate=args.prefill_rate, block_tokens=block)
    policy = make_policy(args.policy or "cache_aware", config, clock=lambda: now[0])
    names = [f"w{w}" for w in range(args.workers)]
    for name in names:
        policy.add_worker(name, args.capacity_tokens)
    seqs = dict.fromkeys(names, 0)
    conversations: list[list[int]] = []  # each request's block keys
    elapsed: list[int] = []
    for i in range(args.decisions):
        if conversations and rng.random() < 0.5:
            keys = conversations[rng.randrange(len(conversations))]
            keys = [*keys[: blocks - 1], rng.randrange(1 << 40)]  # the same prefix, a new turn
        else:
            keys = [rng.randrange(1 << 40) for _ in range(blocks)]
        chain = hasher.hashes(keys, ns)
        conversations.append(keys)
        request = RouteRequest(str(i), ns, tuple(chain), blocks * block + rng.randrange(block))
        now[0] = i * 0.001
        t0 = time.perf_counter_ns()
        decision = policy.route(request)
        elapsed.append(time.perf_counter_ns() - t0)
        worker = decision.worker
        seqs[worker] += 1
        policy.apply_event(worker, KvEvent(worker, seqs[worker], KvEventKind.STORED, tuple(chain)))
        policy.prefill_done(worker, request.request_id)
        policy.finished(worker, request.request_id)
    total_s = sum(elapsed) / 1e9
    return {
        "measurement": "decision_rate",
        "policy": policy.name,
        "workers": args.workers,
        "prompt_tokens": args.prompt_tokens,
        "block_tokens": block,
        "decisions": args.decisions,
        "decisions_per_s": args.decisions / total_s,
        "decision_p50_us": _percentile(elapsed, 0.5) / 1000.0,  # type: ignore[arg-type]
        "decision_p99_us": _percentile(elapsed, 0.99) / 1000.0,  # type: ignore[arg-type]
        "index_bytes": policy.index_bytes(),
    }


@contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection while a policy runs: on a heap of millions of cache nodes
    a full collection takes long enough to land inside the timed routing calls (the router
    process itself holds only its index). Refcounting still frees everything acyclic."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


# -- the command line --------------------------------------------------------------------------
def summary(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="router simulation (TTFT in s; hit rates of prompt tokens)")
    columns: tuple[str, ...] = (
        "policy",
        "hit",
        "of pooled",
        "p50",
        "p90",
        "p99",
        "imbal",
        "win imbal",
        "dec/s",
    )
    if rows and "adapter_swaps" in rows[0]:
        columns += ("mean", "swaps")
    for column in columns:
        table.add_column(column, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(
            str(r["policy"]),
            f"{r['hit_rate']:.3f}",
            f"{r['fraction_of_pooled']:.2f}",
            f"{r['ttft_p50_s']:.3f}",
            f"{r['ttft_p90_s']:.2f}",
            f"{r['ttft_p99_s']:.2f}",
            f"{r['imbalance']:.2f}",
            f"{r['window_imbalance_max']:.2f}",
            f"{r['decisions_per_s']:.0f}",
            *([f"{r['ttft_mean_s']:.3f}", str(r["adapter_swaps"])] if "adapter_swaps" in r else []),
        )
    if rows:
        r = rows[0]
        table.caption = (
            f"pooled hit {r['pooled_hit_rate']:.3f}; floor p50 {r['ttft_floor_p50_s']:.3f} s, "
            f"p99 {r['ttft_floor_p99_s']:.2f} s; {r['workers']} workers x "
            f"{r['capacity_tokens']} tokens at {r['prefill_rate']:.0f} tokens/s"
        )
        if r.get("adapters"):
            table.caption += (
                f"; {r['adapters']} LoRA adapters (Zipf), {r['max_loras']} slots per worker, "
                f"{r['swap_ms']:g} ms a swap"
            )
        if r.get("host_tokens"):
            table.caption += (
                f"; host tier {r['host_tokens']} tokens at {r['host_rate']:.0f} tokens/s, "
                f"host hits {r['host_hit_rate']:.3f} ({rows[0]['policy']})"
            )
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, default=workloads.MOONCAKE_TRACE)
    source.add_argument("--workload", choices=sorted(workloads.SYNTHETIC), default=None)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--capacity-tokens", type=int, default=2_000_000)
    parser.add_argument("--prefill-rate", type=float, default=8000.0, help="tokens/s")
    parser.add_argument("--host-tokens", type=int, default=0, help="host tier per worker")
    parser.add_argument(
        "--host-rate", type=float, default=None, help="host tier tokens/s (10x prefill)"
    )
    parser.add_argument("--policy", choices=sorted(POLICIES), default=None, help="default: all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="first N trace records")
    parser.add_argument("--copies", type=int, default=1, help="trace copies (tenants) at once")
    parser.add_argument("--token-scale", type=int, default=16, help="trace tokens per position")
    parser.add_argument("--event-delay-ms", type=float, default=0.0)
    parser.add_argument(
        "--ablations", action="store_true", help="also greedy with burst order, ours without"
    )
    parser.add_argument("--load", type=float, default=0.7, help="synthetic: offered load")
    parser.add_argument("--adapters", type=int, default=16, help="lora-zipf: LoRA adapters")
    parser.add_argument("--adapter-zipf", type=float, default=1.1, help="lora-zipf: exponent")
    parser.add_argument("--max-loras", type=int, default=4, help="adapter slots per worker")
    parser.add_argument("--swap-ms", type=float, default=50.0, help="an adapter's swap-in")
    parser.add_argument(
        "--batch-share",
        type=float,
        default=0.0,
        help="share of requests that are batch work at priority 1 (workers admit by priority)",
    )
    parser.add_argument(
        "--peer-rate",
        type=float,
        default=0.0,
        help="tokens/s a worker reads a prefix from another (adds cache_aware runs with reads)",
    )
    parser.add_argument("--peer-min-tokens", type=int, default=256, help="the least read")
    parser.add_argument("--decisions", type=int, default=0, help="measure decision rate only")
    parser.add_argument("--prompt-tokens", type=int, default=10_000)
    parser.add_argument("--block-tokens", type=int, default=512, help="decision-rate blocks")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--output", type=Path, default=None, help="also write JSON lines here")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.decisions:
        row = decision_rate(args)
        print(json.dumps(row), flush=True)
        return [row]
    if not args.workload and not args.trace.exists():
        console.print(f"[yellow]no trace at {args.trace}; pass --trace or --workload[/]")
        return []
    stream = load_stream(args)
    pooled = pooled_reference(stream, args)
    rows = []
    runs: list[tuple[str, str, dict[str, Any]]] = [
        (name, name, {}) for name in ([args.policy] if args.policy else list(POLICIES))
    ]
    if args.ablations:
        runs += [(label, name, knobs) for label, (name, knobs) in ABLATIONS.items()]
    if args.workload == "lora-zipf" and args.policy in (None, "cache_aware"):
        runs.append(ADAPTER_BLIND)
    if args.batch_share and args.policy in (None, "cache_aware"):
        runs.append(PRIORITY_BLIND)
    if args.peer_rate and args.policy in (None, "cache_aware"):
        runs += [PEER_READS, PEER_PRICED]
    with progress_bar(console=console, transient=True, disable=args.quiet) as progress:
        for label, name, knobs in runs:
            task = progress.add_task(label, total=len(stream.requests))
            began = time.perf_counter()
            blind = label == PRIORITY_BLIND[0]
            reads = label in (PEER_READS[0], PEER_PRICED[0])
            sim = Simulation(
                stream,
                name,
                args,
                knobs,
                label,
                priority_blind=blind,
                peer_reads=reads,
                peer_priced=label == PEER_PRICED[0],
            )
            with paused_gc():
                sim.run(progress, task)
            row = sim.result(pooled, time.perf_counter() - began)
            rows.append(row)
            print(json.dumps(row), flush=True)
            progress.remove_task(task)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    if args.output is not None:
        args.output.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if rows and "hit_rate" in rows[0]:
        if not console.is_terminal:
            console.width = 120  # logs and pipes: room for every column
        console.print(summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
