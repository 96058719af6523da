"""How fast the against-SGLang loop could run at all in CPython, by how the pages are kept.

benchmarks/against_sglang.py serves one request stream through radixmesh's cache and SGLang's
Python one. At page size 1 radixmesh stays under issue 14's 2x in the cells where nothing is
reused. This benchmark asks what any pure-Python cache could do there: it runs the loop's work
written out flat, as a floor, beside both real caches in the same process.

The cells are the ones where nothing hits (both caches' hit rate is 0.000 there): no-sharing and
multi-turn, KV capacity 5 % of the distinct tokens, page size 1. Every request then evicts the
positions it needs from the least recently used leaves (trimming the last one), allocates a page
a position, caches its whole sequence as a new leaf and hashes the blocks the router's chain does
not cover. So every request moves about 1,100 pages through three state changes. Besides the page
bookkeeping, the floor does only what that needs:
- one dict of leaves for the match;
- a heap of leaves for LRU;
- the router chain's two-end check, and the output's block hashes;
- no locks, namespaces, events, tiers or result objects.

It runs three ways of keeping pages:

- `checked`: what `cache.PagePool` checks, inline. A state byte a page and the free stack in
  numpy; every move checks the state each page leaves, and that no page is listed twice (by stamps,
  as the pool does). Pages are handed around as `array("i")`.
- `runs`: pages as runs `[first, count, first, count, ...]`. The free runs are a stack, handed
  out in the order they were freed (as the pool's stack hands out pages), and a freed run that
  touches the top of the stack merges with it. The same checks are made per run: a count over
  the run's state bytes, a slice assignment, and a sort of the runs for overlaps.
- `unchecked`: the free stack alone and no states, the bookkeeping of SGLang's allocator (a free
  list, no checks).

Each variant evicts the tokens radixmesh evicts, so the floor does the same work, not less:
`tests/benchmarks/test_cache_floor.py` asserts it, and a cell reports any gap
(`evicted_gap_tokens`: radixmesh reused what two random prompts happened to share, such as a
first token). Rounds alternate, and who goes first moves each round. A JSON line per cell goes
to stdout, then a table of microseconds a request. SGLang comes from its wheel
(benchmarks/sglang_radix.py); offline, the floors and radixmesh run without it.

    python benchmarks/cache_floor.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from rich.console import Console
from rich.table import Table
from xxhash import xxh3_64_intdigest

from benchmarks import against_sglang, sglang_radix
from benchmarks.workloads import Request
from cache import DEFAULT_NAMESPACE

console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)

CELLS = (("no-sharing", 0.05), ("multi-turn", 0.05))
FREE, PRIVATE, CACHED = 1, 2, 3
_STAMPS = np.arange(1 << 16, dtype=np.uint16)


class BadMove(Exception):
    """A page was not in the state its move leaves, or was listed twice."""


class UncheckedPages:
    """The free stack alone: no state, no check (what SGLang's allocator keeps)."""

    def __init__(self, pages: int) -> None:
        self.free = np.arange(pages - 1, 0, -1, dtype=np.intc)
        self.top = pages - 1

    def allocate(self, count: int) -> array[int]:
        top = self.top
        self.top = top - count
        return array("i", self.free[top - count : top][::-1].tobytes())

    def claim(self, pages: array[int]) -> None:
        pass

    def release(self, pages: array[int]) -> None:
        self._push(np.frombuffer(pages, dtype=np.intc))

    def _push(self, batch: np.ndarray) -> None:
        top = self.top
        self.free[top : top + len(batch)] = batch[::-1]
        self.top = top + len(batch)

    @staticmethod
    def split(pages: array[int], keep: int) -> tuple[array[int], array[int]]:
        return pages[:keep], pages[keep:]

    @staticmethod
    def join(parts: list[array[int]]) -> array[int]:
        joined = array("i")
        for part in parts:
            joined.extend(part)
        return joined


class CheckedPages(UncheckedPages):
    """`cache.PagePool`'s bookkeeping and checks, without its calls between parts: the free
    stack, a state byte a page, and a stamp a page for the repeated-page check."""

    def __init__(self, pages: int) -> None:
        super().__init__(pages)
        self.state = np.full(pages, FREE, dtype=np.uint8)
        self.state[0] = 0
        self.stamp = np.zeros(pages, dtype=np.uint16)

    def _move(self, pages: array[int], src: int, dst: int) -> np.ndarray:
        """Every page from `src` to `dst`, or `BadMove` (read as unsigned, a negative id is
        out of range and `take` refuses it)."""
        batch = np.frombuffer(pages, dtype=np.intc)
        index = batch.view(np.uint32).astype(np.intp)
        if self.state.take(index).tobytes().count(src) != len(batch):
            raise BadMove(f"a page is not {src}")
        stamps = _STAMPS[: len(batch)]
        self.stamp[index] = stamps
        if self.stamp.take(index).tobytes() != stamps.tobytes():
            raise BadMove("a page is listed twice")
        self.state[index] = dst
        return batch

    def allocate(self, count: int) -> array[int]:
        """As the pool: stack entries are distinct (only checked moves push them), so the
        state is the whole check."""
        top = self.top
        taken = self.free[top - count : top][::-1]
        index = taken.astype(np.intp)
        if self.state.take(index).tobytes().count(FREE) != count:
            raise BadMove("a page on the free stack is not free")
        self.state[index] = PRIVATE
        self.top = top - count
        return array("i", taken.tobytes())

    def claim(self, pages: array[int]) -> None:
        self._move(pages, PRIVATE, CACHED)

    def release(self, pages: array[int]) -> None:
        self._push(self._move(pages, CACHED, FREE))


class RunPages:
    """Pages as runs `[first, count, ...]`, checked run by run. The free runs are a stack, handed
    out in the order they were freed as the pool's stack hands out pages; a freed run merges
    with the top of the stack when they touch."""

    def __init__(self, pages: int) -> None:
        self.state = bytearray([FREE]) * pages
        self.state[0] = 0
        self.fill = {s: bytes([s]) * pages for s in (FREE, PRIVATE, CACHED)}
        self.stack = [(1, pages - 1)]  # (first, count), the next to hand out on top
        self.moves = self.moved_runs = 0

    def _move(self, runs: list[int], src: int, dst: int, repeats: bool = True) -> None:
        """Every run from `src` to `dst`, or `BadMove`; `repeats`: check that no two runs
        overlap (runs taken off the free stack cannot, as the pool's allocate checks none)."""
        state, fill, size = self.state, self.fill[dst], len(self.state)
        for i in range(0, len(runs), 2):
            first, count = runs[i], runs[i + 1]
            if first <= 0 or count <= 0 or first + count > size:
                raise BadMove(f"pages [{first}, {first + count}) are not pages of this pool")
            if state.count(src, first, first + count) != count:
                raise BadMove(f"a page is not {src}")
        if repeats and len(runs) > 2:
            end = 0
            for first, count in sorted(zip(runs[::2], runs[1::2], strict=True)):
                if first < end:
                    raise BadMove("a page is listed twice")
                end = first + count
        for i in range(0, len(runs), 2):
            first, count = runs[i], runs[i + 1]
            state[first : first + count] = fill[:count]
        self.moves += 1
        self.moved_runs += len(runs) // 2

    def allocate(self, count: int) -> list[int]:
        taken: list[int] = []
        stack = self.stack
        while count:
            first, size = stack[-1]
            part = min(size, count)
            if part == size:
                stack.pop()
            else:
                stack[-1] = (first + part, size - part)
            taken += (first, part)  # never touches the run before: see `release`
            count -= part
        self._move(taken, FREE, PRIVATE, repeats=False)
        return taken

    def claim(self, runs: list[int]) -> None:
        self._move(runs, PRIVATE, CACHED)

    def release(self, runs: list[int]) -> None:
        """Free `runs`, pushed last first so that the first is handed out first. A run that
        ends where the top of the stack begins merges with it, so no entry of the stack ever
        ends where the one below it begins (taking part of the top keeps its end)."""
        self._move(runs, CACHED, FREE)
        stack = self.stack
        for i in range(len(runs) - 2, -1, -2):
            first, count = runs[i], runs[i + 1]
            if stack and stack[-1][0] == first + count:
                count += stack.pop()[1]
            stack.append((first, count))

    @staticmethod
    def split(runs: list[int], keep: int) -> tuple[list[int], list[int]]:
        """(the runs of the first `keep` pages, the runs of the rest)."""
        at = 0
        for i in range(0, len(runs), 2):
            count = runs[i + 1]
            if at + count >= keep:
                cut = keep - at
                if cut == count:
                    return runs[: i + 2], runs[i + 2 :]
                first = runs[i]
                return [*runs[:i], first, cut], [first + cut, count - cut, *runs[i + 2 :]]
            at += count
        raise ValueError(f"{keep} pages asked of {at}")

    @staticmethod
    def join(parts: list[list[int]]) -> list[int]:
        return [x for part in parts for x in part]


BOOKKEEPING: dict[str, Callable[[int], Any]] = {
    "checked": CheckedPages,
    "runs": RunPages,
    "unchecked": UncheckedPages,
}


class Leaf:
    """A cached sequence: its keys, its pages (in the bookkeeping's form), how many, its block
    hashes, and when it was last used (the LRU key)."""

    __slots__ = ("blocks", "keys", "pages", "size", "used")

    def __init__(
        self, keys: array[int], pages: Any, size: int, blocks: tuple[int, ...], used: int
    ) -> None:
        self.keys, self.pages, self.size, self.blocks, self.used = keys, pages, size, blocks, used


class Floor:
    """The no-hit request's work, flat, over one of the bookkeepings above (page size 1)."""

    def __init__(self, capacity: int, bookkeeping: str) -> None:
        self.pages = BOOKKEEPING[bookkeeping](capacity + 1)
        self.capacity = self.num_free = capacity
        self.hasher = against_sglang.bench_hasher(1)
        self.block = self.hasher.block_size
        self.seed = self.hasher.namespace_seed(DEFAULT_NAMESPACE)
        self.leaves: dict[int, Leaf] = {}
        self.heap: list[tuple[int, Leaf]] = []  # last use is unique: no two entries tie
        self.clock = 0
        self.evicted = 0

    def prepare(self, request: Request) -> tuple[array[int], array[int], list[int]]:
        """What radixmesh's loop receives: keys and the router's chain, made before it."""
        return against_sglang.prepare_keys(self.hasher, request)

    def serve(self, prepared: tuple[array[int], array[int], list[int]]) -> int:
        """One request: look the prompt up, take the router's chain if both its ends hash
        here, evict what the sequence needs, allocate and claim its pages, hash the blocks
        past the chain, and cache it as a leaf. Returns the positions a whole-leaf match would
        have reused; the floor serves none of them (`evicted_gap` tells a cell that had any)."""
        prompt, output, routed = prepared
        pages, block = self.pages, self.block
        keys = prompt + output
        query = keys[: len(prompt) - 1]
        leaf = self.leaves.get(query[0])  # the match: whole leaves only, as nothing is reused
        reused = len(leaf.keys) if leaf and query[: len(leaf.keys)] == leaf.keys else 0
        end = len(routed) * block
        chain = (  # the router's chain, when both its ends hash here as given
            list(routed)
            if routed
            and end <= len(keys)
            and xxh3_64_intdigest(keys[:block].tobytes(), self.seed) == routed[0]
            and (
                len(routed) == 1
                or xxh3_64_intdigest(keys[end - block : end].tobytes(), routed[-2]) == routed[-1]
            )
            else []
        )
        need = len(keys)
        if need > self.capacity:  # eviction could not make room: say so, before any move
            raise ValueError(f"a sequence of {need} positions cannot fit {self.capacity} pages")
        if need > self.num_free:
            self._evict(need - self.num_free)
        taken = pages.allocate(need)
        self.num_free -= need
        pages.claim(taken)
        parent = chain[-1] if chain else self.seed
        packed = keys[len(chain) * block : need - need % block].tobytes()
        step = block * 8
        for at in range(0, len(packed), step):
            parent = xxh3_64_intdigest(packed[at : at + step], parent)
            chain.append(parent)
        self.clock += 1
        leaf = Leaf(keys, taken, need, tuple(chain), self.clock)
        self.leaves[keys[0]] = leaf
        heapq.heappush(self.heap, (self.clock, leaf))
        return reused  # not served from the leaf (`evicted_gap` tells when a cell reused any)

    def _evict(self, short: int) -> None:
        """Free `short` pages from the least recently used leaves, the last one trimmed in
        place, and release them in one move (the tails in the order radixmesh frees them)."""
        pages, block, tails = self.pages, self.block, []
        self.evicted += short
        self.num_free += short
        while short > 0:
            _, victim = heapq.heappop(self.heap)
            keep = victim.size - short
            if keep > 0:  # trim the last victim in place, as radixmesh does
                victim.pages, tail = pages.split(victim.pages, keep)
                victim.keys, victim.size = victim.keys[:keep], keep
                victim.blocks = victim.blocks[: keep // block]
                heapq.heappush(self.heap, (victim.used, victim))
                tails.append(tail)
                break
            tails.append(victim.pages)
            short -= victim.size
            if self.leaves.get(victim.keys[0]) is victim:
                del self.leaves[victim.keys[0]]
        pages.release(tails[0] if len(tails) == 1 else pages.join(tails[::-1]))

    def evicted_tokens(self) -> int:
        return self.evicted


def contestants(capacity: int, sgl: sglang_radix.SGLang | None) -> dict[str, Callable[[], Any]]:
    """Makers of every side of a cell: the floors, radixmesh, and SGLang when it loaded."""
    makers: dict[str, Callable[[], Any]] = {
        f"floor, {name}": partial(Floor, capacity, name) for name in BOOKKEEPING
    }
    makers["radixmesh"] = lambda: against_sglang.Radixmesh(capacity, 1)
    if sgl is not None:
        makers["sglang"] = lambda: against_sglang.SGLangCache(sgl, capacity, 1)
    return makers


def measure(
    requests: list[Request], capacity: int, sgl: sglang_radix.SGLang | None, rounds: int
) -> dict[str, Any]:
    """Microseconds a request for each side, alternating sides over `rounds` (who goes first
    moves one place each round); the median and all rounds, hit rate and evicted tokens."""
    makers = contestants(capacity, sgl)
    names = list(makers)
    runs: dict[str, list[against_sglang.Run]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(against_sglang.serve_all(makers[name](), requests))
    sides: dict[str, Any] = {}
    for name, done in runs.items():
        us = sorted(1e6 / run.requests_per_s for run in done)
        sides[name] = {
            "us_per_request": us[len(us) // 2],
            "us_all": [1e6 / run.requests_per_s for run in done],
            "hit_rate": done[0].hit_rate,
            "evicted_tokens": done[0].evicted_tokens,
        }
        if "sglang" in runs and name != "sglang":  # its speed over SGLang's, round by round
            ratios = sorted(
                ours.requests_per_s / theirs.requests_per_s
                for ours, theirs in zip(done, runs["sglang"], strict=True)
            )
            sides[name]["of_sglang"] = [ratios[len(ratios) // 2], ratios[0], ratios[-1]]
    return sides


def evicted_gap(sides: dict[str, Any]) -> dict[str, int]:
    """Tokens each floor evicted beyond radixmesh (0: the same work). radixmesh evicts less by
    what it happened to reuse, such as a first token two random prompts share; a negative gap
    would mean a floor did less than radixmesh."""
    ours = sides["radixmesh"]["evicted_tokens"]
    return {
        name: side["evicted_tokens"] - ours
        for name, side in sides.items()
        if name.startswith("floor")
    }


def run_pages_fragmentation(requests: list[Request], capacity: int) -> float:
    """Runs per move of the `runs` bookkeeping over the stream (untimed)."""
    floor = Floor(capacity, "runs")
    for request in requests:
        floor.serve(floor.prepare(request))
    pages = floor.pages
    assert isinstance(pages, RunPages)
    return pages.moved_runs / max(1, pages.moves)


def table(rows: list[dict[str, Any]]) -> Table:
    out = Table(
        title="microseconds a request at page size 1 (median over rounds), and the speed over "
        "SGLang's (median, min-max of the rounds)"
    )
    out.add_column("workload", justify="right")
    out.add_column("capacity", justify="right")
    sides = list(rows[0]["sides"])
    for side in sides:
        out.add_column(side, justify="right")
    out.add_column("runs a move", justify="right")
    for row in rows:
        cells = []
        for side in row["sides"].values():
            cell = f"{side['us_per_request']:.1f}"
            if "of_sglang" in side:
                cell += " ({:.2f}x, {:.2f}-{:.2f})".format(*side["of_sglang"])
            cells.append(cell)
        out.add_row(
            row["workload"],
            f"{row['capacity_fraction']:.0%}",
            *cells,
            f"{row['runs_per_move']:.1f}",
        )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds a cell")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of each stream")
    parser.add_argument(
        "--sglang-wheel-dir", type=Path, default=None, help="where the sglang wheel is kept"
    )
    parser.add_argument("--output", type=Path, default=None, help="also write JSON lines here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or not 0 < args.scale <= 1:
        parser.error("--rounds must be >= 1 and --scale in (0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="radixmesh-sglang-") as tmp:
        wheel = sglang_radix.fetch_wheel(args.sglang_wheel_dir or Path(tmp))
        sgl = None if wheel is None else sglang_radix.load(wheel, Path(tmp) / "src")
        if sgl is None:
            console.print("[yellow]SGLang's wheel could not be fetched: measuring ours only[/]")
        for name, fraction in CELLS:
            requests = against_sglang.WORKLOADS[name]()
            requests = requests[: max(1, int(len(requests) * args.scale))]
            distinct = against_sglang.distinct_tokens(requests)
            capacity = against_sglang.capacity_tokens(requests, distinct, fraction, 1)
            console.print(f"{name}, {fraction:.0%}: {args.rounds} rounds", highlight=False)
            gc.collect()
            row: dict[str, Any] = {
                "workload": name,
                "capacity_fraction": fraction,
                "capacity_tokens": capacity,
                "page_size": 1,
                "requests": len(requests),
                "rounds": args.rounds,
                "sides": measure(requests, capacity, sgl, args.rounds),
                "runs_per_move": run_pages_fragmentation(requests, capacity),
            }
            row["evicted_gap_tokens"] = gaps = evicted_gap(row["sides"])
            if any(gaps.values()):
                console.print(f"[yellow]{name}: tokens evicted beyond radixmesh: {gaps}[/]")
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.output is not None:
        args.output.write_text("".join(json.dumps(row) + "\n" for row in rows))
    console.print(table(rows))
    return 0


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    console.print(f"{time.perf_counter() - started:.0f} s", highlight=False)
    raise SystemExit(code)
