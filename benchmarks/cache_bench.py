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
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pympler import asizeof
from rich.console import Console
from rich.progress import track
from rich.table import Table

from benchmarks import against_sglang, workloads
from benchmarks.simple_trie import SimpleTrie
from benchmarks.workloads import Request
from cache import CacheConfig, CachedSequence, CacheNamespace, OutOfPages, OutOfSlots, SequenceCache

console = Console(stderr=True)


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


def _percentile(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0


def _progress(requests: list[Request], label: str, quiet: bool) -> Iterable[Request]:
    if quiet:
        return requests
    return track(requests, description=label, console=console, transient=True)


def run_radixmesh(
    requests: list[Request],
    capacity: int | None,
    page_size: int,
    window: int,
    memory: bool = True,
    quiet: bool = False,
) -> RunResult:
    if capacity is None:
        capacity = sum(len(r.prompt) + len(r.output) + page_size for r in requests)
    config = CacheConfig(
        capacity // page_size + 1,
        page_size,
        max_sequences=window + 2,
        block_size=max(16, page_size),
    )
    cache = SequenceCache(config)
    namespaces: dict[str | None, CacheNamespace] = {}
    inflight: deque[tuple[CachedSequence, int]] = deque()
    start_ns: list[int] = []
    commit_ns: list[int] = []
    rejected = 0
    clock = time.perf_counter_ns
    began = time.perf_counter()
    for req in _progress(requests, "radixmesh", quiet):
        ns = namespaces.setdefault(req.tenant, CacheNamespace(tenant=req.tenant))
        total = len(req.prompt) + len(req.output)
        seq = None
        while seq is None:
            try:
                t0 = clock()
                seq = cache.start(req.prompt, ns, reserve=total)
                start_ns.append(clock() - t0)
            except (OutOfPages, OutOfSlots):
                if not inflight:
                    break
                cache.finish(*inflight.popleft())
        if seq is None:
            rejected += 1
            continue
        cache.take_page_copies(seq)  # a worker copies these before its forward pass
        t0 = clock()
        cache.commit(seq, len(req.prompt))
        commit_ns.append(clock() - t0)
        cache.append(seq, req.output)
        inflight.append((seq, total - 1))  # the last sampled token has no KV yet
        if len(inflight) > window:
            cache.finish(*inflight.popleft())
    while inflight:
        cache.finish(*inflight.popleft())
    wall = time.perf_counter() - began
    cached = cache.tree.cached_pages * page_size
    return RunResult(
        requests_per_s=len(requests) / wall,
        hit_rate=cache.stats.reused_positions / max(1, cache.stats.prompt_positions),
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
    )


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


def bench_workload(name: str, requests: list[Request], args: argparse.Namespace) -> dict:
    quiet, memory = args.quiet, not args.no_memory
    ideal = run_simple_trie(requests, None, args.window, False, quiet, "ideal (infinite)")
    if args.capacity is not None:
        capacity = args.capacity
    else:
        largest = max(len(r.prompt) + len(r.output) for r in requests)
        capacity = max(int(args.capacity_fraction * ideal.cached_tokens), 2 * largest)
    ours = run_radixmesh(requests, capacity, args.page_size, args.window, memory, quiet)
    lru = run_simple_trie(requests, capacity, args.window, memory, quiet)
    unbounded = run_radixmesh(requests, None, args.page_size, args.window, False, quiet)
    return {
        "workload": name,
        "requests": len(requests),
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "distinct_tokens": ideal.cached_tokens,
        "capacity_tokens": capacity,
        "page_size": args.page_size,
        "window": args.window,
        "ideal_hit_rate": ideal.hit_rate,
        "radixmesh": asdict(ours),
        "radixmesh_unbounded_hit_rate": unbounded.hit_rate,
        "simple_trie_lru": asdict(lru),
        "throughput_ratio_vs_simple_trie": ours.requests_per_s / lru.requests_per_s,
        "hit_rate_minus_lru": ours.hit_rate - lru.hit_rate,
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [*workloads.SYNTHETIC, "mooncake"]
    parser.add_argument("--workloads", nargs="+", choices=names, default=names)
    parser.add_argument("--capacity", type=int, default=None, help="tokens of KV in the pool")
    parser.add_argument(
        "--capacity-fraction",
        type=float,
        default=0.25,
        help="without --capacity: this fraction of the workload's distinct tokens",
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
    return parser.parse_args(argv)


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
    for name, requests in load_workloads(args):
        row = bench_workload(name, requests, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.output is not None:
        args.output.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if rows:
        console.print(summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
