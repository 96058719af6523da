"""Trace-driven benchmark of the radix cache in its serving loop, against a simple trie.

Per workload, the same seeded request stream goes through:

- radixmesh's `SequenceCache` (match + lock + allocate with eviction at `start`, insert at
  `commit`, generated tokens cached at `finish`), with a window of requests in flight;
- the same loop on a deliberately simple one-token-per-node trie with plain LRU (the baseline of
  throughput and hit rate);
- the simple trie with no capacity: the ideal hit rate of an infinite cache;
- radixmesh with no capacity, whose hit rate must equal the ideal.

Prints one JSON object per workload on stdout (and to --output), then a summary table on stderr.
Capacity is in tokens; by default it is a fraction of the workload's distinct tokens, which
forces eviction. Run: `python benchmarks/cache_bench.py [--workloads ...] [--capacity N]`.
`--host-multiple M` gives radixmesh a host tier of M times its device capacity (cache/tiers.py):
evicted pages are demoted there and promoted back when a match reaches them.

`--tiers` instead measures issue 15's tier target per workload, in one run: the device tier alone
at --capacity-fraction (default 5 %) of the distinct tokens, the same device tier with a host
tier --host-multiple (default 8) times larger, and an unbounded cache; the hit rate of each and
its gap to the unbounded one (the target: within 5 % of it). A fourth run, one device pool as
large as both tiers together, tells what the total capacity misses from what the tiering loses.
A fifth adds the worker's disk tier as it keeps what eviction drops (worker/disk_spill.py):
every block of a node dropped from the host, and of the nodes above it, is on disk (no bound:
the disk's size is the distinct positions it holds, reported), and a prompt's hit reaches as
far as its leading blocks are cached or on disk, as the worker reads them back before its
prefill.

`--against sglang` instead runs SGLang's Python RadixCache (fetched from its wheel at run time) and
radixmesh's in one serving loop over 16 cells: benchmarks/against_sglang.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pympler import asizeof
from rich.console import Console
from rich.table import Table

from benchmarks import against_sglang, workloads
from benchmarks.simple_trie import SimpleTrie
from benchmarks.workloads import Request
from cache import CacheConfig, CachedSequence, CacheNamespace, OutOfPages, OutOfSlots, SequenceCache
from cache.radix_node import Node
from cache.tiers import TierCopy
from cluster.progress import track

console = Console(stderr=True)
TIER_TARGET_PCT = 5.0
"""Issue 15: with a host tier the hit rate is within this % of an unbounded cache's."""


@dataclass
class TierCounters:
    """What the host tier did in one run (cache/tiers.py); pages are `page_size` positions."""

    host_capacity_tokens: int
    demoted_pages: int
    """Device pages copied down on eviction."""
    promoted_pages: int
    """Host pages copied back to the device for a match."""
    host_evicted_pages: int
    """Host pages dropped to make room there."""
    adopted_pages: int
    """Host pages replaced by a prefill's own device pages at insert (nothing copied)."""
    host_hit_tokens: int
    """Prompt positions served from pages that `start` promoted."""
    copied_pages: int
    """Pages of the `TierCopy`s the loop drained (a worker would copy these)."""
    disk_hit_tokens: int = 0
    """Prompt positions found on the simulated disk beyond what the tiers held (with a disk)."""
    disk_tokens: int = 0
    """Distinct positions the simulated disk holds at the end: the blocks ever dropped."""


@dataclass
class RunResult:
    requests_per_s: float
    hit_rate: float
    match_us_p50: float = 0.0
    """`SequenceCache.start`: match, lock, map, allocate (evicting when it must)."""
    match_us_p99: float = 0.0
    insert_us_p50: float = 0.0
    """`SequenceCache.commit` of the prompt: insert, duplicate swap, lock move."""
    insert_us_p99: float = 0.0
    nodes: int = 0
    cached_tokens: int = 0
    bytes_per_cached_token: float | None = None
    evicted_tokens: int = 0
    rejected: int = 0
    wall_s: float = 0.0
    tiers: TierCounters | None = None
    """With a host tier only."""


def as_row(result: RunResult) -> dict:
    """`result` as a JSON object (without `tiers` when there was no host tier)."""
    row = asdict(result)
    if result.tiers is None:
        del row["tiers"]
    return row


def _percentile(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0


def _progress(requests: list[Request], label: str, quiet: bool) -> Iterable[Request]:
    return requests if quiet else track(requests, label, console)


def run_radixmesh(
    requests: list[Request],
    capacity: int | None,
    page_size: int,
    window: int,
    memory: bool = True,
    quiet: bool = False,
    host_capacity: int = 0,
    label: str = "radixmesh",
    disk: bool = False,
) -> RunResult:
    """`host_capacity` (tokens): a host tier of that size; `start` promotes what a prompt finds
    there, as the worker's does, and the loop drains the tier copies a worker would perform.
    `disk`: a disk tier keeping every block eviction drops (the module's docstring)."""
    if capacity is None:
        capacity = sum(len(r.prompt) + len(r.output) + page_size for r in requests)
    config = CacheConfig(
        capacity // page_size + 1,
        page_size,
        max_sequences=window + 2,
        block_size=max(16, page_size),
        host_pages=host_capacity // page_size + 1 if host_capacity else 0,
    )
    cache = SequenceCache(config)
    on_disk: set[int] = set()
    if disk:
        cache.tree.on_drop = partial(_to_disk, on_disk)
    disk_hits = 0
    namespaces: dict[str | None, CacheNamespace] = {}
    inflight: deque[tuple[CachedSequence, int]] = deque()
    start_ns: list[int] = []
    commit_ns: list[int] = []
    rejected = copied = 0
    clock = time.perf_counter_ns
    began = time.perf_counter()
    for req in _progress(requests, label, quiet):
        ns = namespaces.setdefault(req.tenant, CacheNamespace(tenant=req.tenant))
        total = len(req.prompt) + len(req.output)
        seq = _start(cache, req.prompt, ns, total, inflight, start_ns)
        if seq is None:
            rejected += 1
            continue
        if disk:
            disk_hits += _disk_hit(cache, on_disk, req.prompt, ns, seq.reused)
        # a worker performs these (tier copies first) before its forward pass
        for copy in cache.take_page_copies(seq):
            if isinstance(copy, TierCopy):
                copied += len(copy.src_pages)
        t0 = clock()
        cache.commit(seq, len(req.prompt))
        commit_ns.append(clock() - t0)
        cache.append(seq, req.output)
        inflight.append((seq, total - 1))  # the last sampled token has no KV yet
        if len(inflight) > window:
            cache.finish(*inflight.popleft())
    while inflight:
        cache.finish(*inflight.popleft())
    copied += sum(len(copy.src_pages) for copy in cache.take_tier_copies())
    wall = time.perf_counter() - began
    cached = cache.tree.cached_pages * page_size
    tree = cache.tree
    tiers = None
    if host_capacity:
        tiers = TierCounters(
            host_capacity_tokens=host_capacity,
            demoted_pages=tree.demoted_pages,
            promoted_pages=tree.promoted_pages,
            host_evicted_pages=tree.host_evicted_pages,
            adopted_pages=tree.adopted_pages,
            host_hit_tokens=cache.stats.host_positions,
            copied_pages=copied,
            disk_hit_tokens=disk_hits,
            disk_tokens=len(on_disk) * config.block_size,
        )
    reused = cache.stats.reused_positions + disk_hits
    return RunResult(
        requests_per_s=len(requests) / wall,
        hit_rate=reused / max(1, cache.stats.prompt_positions),
        match_us_p50=_percentile(start_ns, 0.5),
        match_us_p99=_percentile(start_ns, 0.99),
        insert_us_p50=_percentile(commit_ns, 0.5),
        insert_us_p99=_percentile(commit_ns, 0.99),
        nodes=cache.tree.node_count,
        cached_tokens=cached,
        bytes_per_cached_token=asizeof.asizeof(cache) / max(1, cached) if memory else None,
        evicted_tokens=cache.tree.evicted_pages * page_size,
        rejected=rejected,
        wall_s=wall,
        tiers=tiers,
    )


def _start(
    cache: SequenceCache,
    prompt: list[int],
    ns: CacheNamespace,
    total: int,
    inflight: deque[tuple[CachedSequence, int]],
    start_ns: list[int],
) -> CachedSequence | None:
    """`cache.start`, finishing the oldest requests in flight while pages or slots run out;
    None when nothing is left to finish. Each call's nanoseconds go to `start_ns`."""
    clock = time.perf_counter_ns
    while True:
        try:
            t0 = clock()
            seq = cache.start(prompt, ns, reserve=total)
            start_ns.append(clock() - t0)
            return seq
        except (OutOfPages, OutOfSlots):
            if not inflight:
                return None
            cache.finish(*inflight.popleft())


def _to_disk(on_disk: set[int], node: Node) -> list:
    """The simulated disk keeps the blocks of a dropped node and of the nodes above it (the
    worker writes the unsaved ones with it); nothing to copy here. Blocks are chained hashes
    of the prefix, so a node whose last block is there has its whole path there."""
    while node.parent is not None and not (node.blocks and node.blocks[-1] in on_disk):
        on_disk.update(node.blocks)
        node = node.parent
    return []


def _disk_hit(
    cache: SequenceCache, on_disk: set[int], prompt: list[int], ns: CacheNamespace, reused: int
) -> int:
    """Positions of `prompt` past the `reused` ones that its leading blocks on the simulated
    disk cover (whole pages, at most all but the last position, as a worker reads them)."""
    if not on_disk:
        return 0
    block, page = cache.hasher.block_size, cache.pool.page_size
    hashes = cache.hasher.hashes(prompt, ns)
    depth = reused // block
    while depth < len(hashes) and hashes[depth] in on_disk:
        depth += 1
    reach = min(depth * block, len(prompt) - 1) // page * page
    return max(0, reach - reused)


def run_simple_trie(
    requests: list[Request],
    capacity: int | None,
    window: int,
    memory: bool = True,
    quiet: bool = False,
    label: str = "simple trie",
) -> RunResult:
    trie = SimpleTrie(capacity)
    inflight: deque[tuple[object, Request]] = deque()
    hits = total = rejected = 0

    def finish_oldest() -> None:
        leaf, req = inflight.popleft()
        trie.insert(leaf, req.prompt + req.output[:-1], len(req.prompt))  # type: ignore[arg-type]
        trie.private -= 1  # the last sampled token's slot: never computed
        trie.unlock(leaf)  # type: ignore[arg-type]

    began = time.perf_counter()
    for req in _progress(requests, label, quiet):
        n = len(req.prompt)
        length, node = trie.match(req.prompt)
        reuse = min(length, n - 1)
        trie.lock(node)
        while not trie.reserve(n - reuse + len(req.output)):
            if not inflight:
                break
            finish_oldest()
        else:
            hits += reuse
            total += n
            leaf = trie.insert(node, req.prompt, length)
            trie.private -= length - reuse  # a full hit's recomputed position was a duplicate
            trie.lock(leaf)
            trie.unlock(node)
            inflight.append((leaf, req))
            if len(inflight) > window:
                finish_oldest()
            continue
        trie.unlock(node)
        rejected += 1
    while inflight:
        finish_oldest()
    wall = time.perf_counter() - began
    return RunResult(
        requests_per_s=len(requests) / wall,
        hit_rate=hits / max(1, total),
        nodes=trie.cached,
        cached_tokens=trie.cached,
        bytes_per_cached_token=asizeof.asizeof(trie) / max(1, trie.cached) if memory else None,
        rejected=rejected,
        wall_s=wall,
    )


def _capacity(requests: list[Request], distinct: int, args: argparse.Namespace) -> int:
    """Device capacity in tokens: --capacity, else --capacity-fraction of the distinct tokens
    (at least twice the largest request, so that every request fits)."""
    if args.capacity is not None:
        return int(args.capacity)
    largest = max(len(r.prompt) + len(r.output) for r in requests)
    return max(int(args.capacity_fraction * distinct), 2 * largest)


def bench_workload(name: str, requests: list[Request], args: argparse.Namespace) -> dict:
    quiet, memory = args.quiet, not args.no_memory
    ideal = run_simple_trie(requests, None, args.window, False, quiet, "ideal (infinite)")
    capacity = _capacity(requests, ideal.cached_tokens, args)
    host = args.host_multiple * capacity
    ours = run_radixmesh(
        requests, capacity, args.page_size, args.window, memory, quiet, host_capacity=host
    )
    lru = run_simple_trie(requests, capacity, args.window, memory, quiet)
    unbounded = run_radixmesh(requests, None, args.page_size, args.window, False, quiet)
    row = {
        "workload": name,
        "requests": len(requests),
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "distinct_tokens": ideal.cached_tokens,
        "capacity_tokens": capacity,
        "page_size": args.page_size,
        "window": args.window,
        "ideal_hit_rate": ideal.hit_rate,
        "radixmesh": as_row(ours),
        "radixmesh_unbounded_hit_rate": unbounded.hit_rate,
        "simple_trie_lru": asdict(lru),
        "throughput_ratio_vs_simple_trie": ours.requests_per_s / lru.requests_per_s,
        "hit_rate_minus_lru": ours.hit_rate - lru.hit_rate,
    }
    if host:
        row["host_capacity_tokens"] = host
    return row


def bench_tiers(name: str, requests: list[Request], args: argparse.Namespace) -> dict:
    """Issue 15's tier cell: device alone, device + host, unbounded; the same stream each."""
    quiet, ps, window = args.quiet, args.page_size, args.window
    ideal = run_simple_trie(requests, None, window, False, quiet, "ideal (infinite)")
    capacity = _capacity(requests, ideal.cached_tokens, args)
    host = args.host_multiple * capacity
    runs = {
        "device_only": run_radixmesh(requests, capacity, ps, window, False, quiet),
        "device_host": run_radixmesh(
            requests, capacity, ps, window, False, quiet, host, "radixmesh + host"
        ),
        "unbounded": run_radixmesh(requests, None, ps, window, False, quiet),
        # a reference: one device pool as large as both tiers together, so that a gap can be
        # told apart into what the total capacity misses and what the tiering loses
        "device_total": run_radixmesh(
            requests, (1 + args.host_multiple) * capacity, ps, window, False, quiet
        ),
        "device_host_disk": run_radixmesh(
            requests, capacity, ps, window, False, quiet, host, "radixmesh + host + disk", True
        ),
    }
    best = runs["unbounded"].hit_rate
    configs = {}
    for key, run in runs.items():
        configs[key] = as_row(run)
        configs[key]["gap_points"] = 100 * (best - run.hit_rate)
        configs[key]["gap_pct_of_unbounded"] = 100 * (best - run.hit_rate) / best if best else 0.0
    return {
        "workload": name,
        "mode": "tiers",
        "requests": len(requests),
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "distinct_tokens": ideal.cached_tokens,
        "page_size": ps,
        "window": window,
        "device_capacity_tokens": capacity,
        "device_fraction": capacity / max(1, ideal.cached_tokens),
        "host_multiple": args.host_multiple,
        "host_capacity_tokens": host,
        "ideal_hit_rate": ideal.hit_rate,
        "configs": configs,
        "target_gap_pct": TIER_TARGET_PCT,
        "within_target": configs["device_host"]["gap_pct_of_unbounded"] <= TIER_TARGET_PCT,
        "within_target_with_disk": (
            configs["device_host_disk"]["gap_pct_of_unbounded"] <= TIER_TARGET_PCT
        ),
    }


def load_workloads(args: argparse.Namespace) -> list[tuple[str, list[Request]]]:
    chosen = []
    sizes = {"n": 400} if args.quick else {}
    for name in args.workloads:
        if name == "mooncake":
            if not args.trace.exists():
                console.print(f"[yellow]skipping mooncake: {args.trace} is absent[/]")
                continue
            limit = 300 if args.quick else args.mooncake_limit
            chosen.append((name, workloads.mooncake(args.trace, args.mooncake_block, limit)))
        elif name == "multi-turn":
            size = {"conversations": 40} if args.quick else {}
            chosen.append((name, workloads.multi_turn(args.seed, **size)))
        else:
            chosen.append((name, workloads.SYNTHETIC[name](args.seed, **sizes)))
    return chosen


def summary(rows: list[dict]) -> Table:
    table = Table(title="radix cache vs simple trie (same stream, same capacity)")
    for column in (
        "workload",
        "req/s",
        "trie req/s",
        "ratio",
        "hit",
        "LRU hit",
        "ideal",
        "unbounded",
        "match p50/p99 us",
        "insert p50/p99 us",
        "nodes",
        "B/token",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        ours, lru = row["radixmesh"], row["simple_trie_lru"]
        per_token = ours["bytes_per_cached_token"]
        table.add_row(
            row["workload"],
            f"{ours['requests_per_s']:.0f}",
            f"{lru['requests_per_s']:.0f}",
            f"{row['throughput_ratio_vs_simple_trie']:.1f}x",
            f"{ours['hit_rate']:.3f}",
            f"{lru['hit_rate']:.3f}",
            f"{row['ideal_hit_rate']:.3f}",
            f"{row['radixmesh_unbounded_hit_rate']:.3f}",
            f"{ours['match_us_p50']:.0f}/{ours['match_us_p99']:.0f}",
            f"{ours['insert_us_p50']:.0f}/{ours['insert_us_p99']:.0f}",
            str(ours["nodes"]),
            "-" if per_token is None else f"{per_token:.1f}",
        )
    return table


def _device_tokens(row: dict, key: str) -> str:
    if key == "unbounded":
        return "-"
    times = 1 + row["host_multiple"] if key == "device_total" else 1
    capacity = times * row["device_capacity_tokens"]
    return f"{capacity:,} ({times * row['device_fraction']:.1%})"


def tier_summary(rows: list[dict]) -> Table:
    table = Table(
        title=f"host tier: hit rate vs an unbounded cache (issue 15 target: gap <= "
        f"{TIER_TARGET_PCT:g} % of unbounded)"
    )
    columns = ["workload", "page", "config", "device tok", "host tok", "hit", "gap pts", "gap %"]
    columns += ["demoted", "promoted", "host-evicted", "req/s"]
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        names = {
            "device_only": "device",
            "device_host": "device + host",
            "unbounded": "unbounded",
            "device_total": f"device x{1 + row['host_multiple']}",
            "device_host_disk": "device + host + disk",
        }
        for key, label in names.items():
            run = row["configs"][key]
            tiers = run.get("tiers")
            table.add_row(
                row["workload"],
                str(row["page_size"]),
                label,
                _device_tokens(row, key),
                f"{tiers['host_capacity_tokens']:,}" if tiers else "-",
                f"{run['hit_rate']:.4f}",
                f"{run['gap_points']:.2f}",
                f"{run['gap_pct_of_unbounded']:.1f}",
                f"{tiers['demoted_pages']:,}" if tiers else "-",
                f"{tiers['promoted_pages']:,}" if tiers else "-",
                f"{tiers['host_evicted_pages']:,}" if tiers else "-",
                f"{run['requests_per_s']:.0f}",
            )
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [*workloads.SYNTHETIC, "mooncake"]
    parser.add_argument("--workloads", nargs="+", choices=names, default=names)
    parser.add_argument("--capacity", type=int, default=None, help="tokens of KV in the pool")
    parser.add_argument(
        "--capacity-fraction",
        type=float,
        default=None,
        help="without --capacity: this fraction of the workload's distinct tokens "
        "(default 0.25; 0.05 with --tiers)",
    )
    parser.add_argument(
        "--host-multiple",
        type=int,
        default=None,
        help="a host tier this many times the device capacity (default 0: none; 8 with --tiers)",
    )
    parser.add_argument(
        "--tiers",
        action="store_true",
        help="per workload: device alone, device + host tier, unbounded (issue 15's target)",
    )
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--window", type=int, default=8, help="requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", type=Path, default=workloads.MOONCAKE_TRACE)
    parser.add_argument("--mooncake-block", type=int, default=32, help="tokens per 512-block")
    parser.add_argument("--mooncake-limit", type=int, default=None, help="first N trace records")
    parser.add_argument("--quick", action="store_true", help="small streams (tests, smoke runs)")
    parser.add_argument("--no-memory", action="store_true", help="skip the deep memory sizing")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--output", type=Path, default=None, help="also write JSON lines here")
    against = parser.add_argument_group(
        "--against sglang", "SGLang's Python RadixCache in the same loop (see against_sglang.py)"
    )
    against.add_argument("--against", choices=["sglang"], default=None)
    against.add_argument("--rounds", type=int, default=3, help="alternating rounds a cell")
    against.add_argument(
        "--scale", type=float, default=1.0, help="run this fraction of each request stream"
    )
    against.add_argument(
        "--sglang-wheel-dir", type=Path, default=None, help="reuse a downloaded wheel from here"
    )
    args = parser.parse_args(argv)
    if args.capacity_fraction is None:
        args.capacity_fraction = 0.05 if args.tiers else 0.25
    if args.host_multiple is None:
        args.host_multiple = 8 if args.tiers else 0
    if args.host_multiple < 0 or (args.tiers and args.host_multiple == 0):
        parser.error("--host-multiple must be >= 0, and > 0 with --tiers")
    if args.against and (args.tiers or args.host_multiple):
        parser.error("--against sglang measures the device cache alone: no --tiers, no host tier")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.against == "sglang":
        names = [n for n in against_sglang.WORKLOADS if n in args.workloads]
        return against_sglang.run(
            names or list(against_sglang.WORKLOADS),
            args.rounds,
            not args.no_memory,
            args.output,
            args.sglang_wheel_dir,
            scale=args.scale,
        )
    rows = []
    bench = bench_tiers if args.tiers else bench_workload
    for name, requests in load_workloads(args):
        row = bench(name, requests, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.output is not None:
        args.output.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if rows:
        console.print(tier_summary(rows) if args.tiers else summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
