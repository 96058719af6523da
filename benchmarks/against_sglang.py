"""radixmesh's prefix cache against SGLang's Python one, in one serving loop, same process,
alternating. That is `RadixCache` of sglang/srt/mem_cache/radix_cache.py; SGLang 0.5.23 serves by
default with `UnifiedRadixCache` over a compiled Rust tree core, which this does not measure.

Each request runs the loop a scheduler runs for it, one request in flight:

    match the prompt (all but its last token, whose logits must be computed)
    lock the matched node
    evict on demand, then allocate the pages the rest of the sequence needs
    insert the page-aligned sequence (prompt and output), free any duplicate pages the insert
    reported and the partial last page, unlock

radixmesh runs `cache.RadixCache` over `cache.PagePool` with block hashing on (as the worker
always runs it). As the worker's engine thread does, it receives the prompt's cache keys made
before the loop (the worker makes them on the thread that submits the request:
`RequestState.prompt_keys`) and the output's keys made as its tokens were generated, and it
takes the prompt's block hashes from the router when they check out (`BlockHasher.accepts`,
told the keys are text as the worker tells it: `to_cache_keys` checked the ids when it made
them), hashing only the blocks past them (the output's). SGLang runs its `RadixCache` over its
`TokenToKVPoolAllocator` (page 1) or `PagedTokenToKVPoolAllocator`, CPU tensors, KV events off
(its default), and receives prompt and output ids as `array("q")`, as its scheduler holds them.
Both see the same requests and the same capacity in tokens.

Memory is measured in a separate, untimed pass: the tracemalloc peak of the run, plus for SGLang
the bytes of the CPU tensors it holds when the run ends with the cache full (torch's allocator is
invisible to tracemalloc). `pool B/page` is each allocator's own bookkeeping per page of capacity.
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import time
import tracemalloc
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks import sglang_radix, workloads
from benchmarks.workloads import Request
from cache import DEFAULT_NAMESPACE, BlockHasher, IdentityScheme, PagePool, RadixCache
from cache.config import CacheConfig
from cache.tokens import Keys, to_cache_keys
from cluster.progress import progress_bar

console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)

WORKLOADS: dict[str, Callable[[], list[Request]]] = {
    "system-prompts": lambda: workloads.system_prompts(0),
    "multi-turn": lambda: workloads.multi_turn(0),
    "few-shot": lambda: workloads.few_shot(0),
    "no-sharing": lambda: workloads.no_sharing(0),
}
CAPACITIES = (0.30, 0.05)
PAGE_SIZES = (1, 16)


@dataclass
class Run:
    requests_per_s: float
    hit_rate: float
    evicted_tokens: int


def distinct_tokens(requests: list[Request]) -> int:
    """Tokens an infinite cache of whole sequences would hold (a trie of every sequence)."""
    root: dict[int, Any] = {}
    count = 0
    for req in requests:
        node = root
        for token in req.prompt + req.output:
            child = node.get(token)
            if child is None:
                child = node[token] = {}
                count += 1
            node = child
    return count


def capacity_tokens(requests: list[Request], distinct: int, fraction: float, page_size: int) -> int:
    """`fraction` of the `distinct` tokens (`distinct_tokens`, counted once per stream), at least
    two of the longest request, in whole pages."""
    largest = max(len(r.prompt) + len(r.output) for r in requests)
    tokens = max(int(fraction * distinct), 2 * (largest + page_size))
    return tokens - tokens % page_size


def bench_hasher(page_size: int) -> BlockHasher:
    """radixmesh's block hasher in the loop: the worker's block size, at least a page."""
    block = CacheConfig(2, page_size).block_size
    return BlockHasher(IdentityScheme(max(block, page_size), "bench"))


def prepare_keys(hasher: BlockHasher, req: Request) -> tuple[Keys, Keys, list[int]]:
    """The prompt's and the output's cache keys, and the prompt's block hashes (the router's)."""
    keys = to_cache_keys(req.prompt)
    return keys, to_cache_keys(req.output), hasher.hashes(keys, DEFAULT_NAMESPACE)


class Radixmesh:
    name = "radixmesh"

    def __init__(self, capacity: int, page_size: int) -> None:
        self.page_size = page_size
        self.pool = PagePool(capacity // page_size + 1, page_size)
        self.hasher = bench_hasher(page_size)
        self.tree = RadixCache(self.pool, self.hasher)

    def prepare(self, req: Request) -> Any:
        """The worker's engine thread receives the prompt's cache keys, made when the request
        was submitted (`RequestState.prompt_keys`, on the submitting thread), and the prompt's
        block hashes, which the router computed to route it. The output's keys are made as
        its tokens are generated (`SequenceCache.append`, one a decode step), before the
        sequence is cached: SGLang's side likewise gets its output ids ready."""
        return prepare_keys(self.hasher, req)

    def serve(self, prepared: Any) -> int:
        """One request through the loop; returns the prompt tokens served from the cache."""
        ps, pool, tree = self.page_size, self.pool, self.tree
        prompt, output, routed = prepared
        keys = prompt + output
        match = tree.match(keys[: len(prompt) - 1], DEFAULT_NAMESPACE)
        chain = match.block_hashes  # as SequenceCache.start takes the router's when it checks
        if len(routed) > len(chain) and self.hasher.accepts(
            routed,
            keys,
            DEFAULT_NAMESPACE,
            text=True,  # as the worker: keys made from ids
        ):
            chain = list(routed)
        node = match.last_node
        tree.lock(node)
        need = -(-len(keys) // ps) - len(match.pages)
        if need > pool.num_free:
            tree.evict(need - pool.num_free)
        fresh = pool.allocate(need)
        whole = len(keys) // ps
        result = tree.insert(
            keys[: whole * ps],
            match.pages + fresh[: whole - len(match.pages)],
            DEFAULT_NAMESPACE,
            from_node=node,
            block_hashes=chain,
        )
        spare = fresh[whole - len(match.pages) :]  # the partial last page
        if result.existing_pages:  # the tree already had pages past the match: ours duplicate
            spare += fresh[: len(result.existing_pages)]
        pool.free_private(spare)
        tree.unlock(node)
        return match.length

    def evicted_tokens(self) -> int:
        return self.tree.evicted_pages * self.page_size

    def pool_bytes_per_page(self) -> float:
        return self.pool.nbytes / self.pool.num_pages

    def held_tensor_bytes(self) -> int:
        return 0


class SGLangCache:
    def __init__(self, sgl: sglang_radix.SGLang, capacity: int, page_size: int) -> None:
        import torch

        self.sgl, self.page_size, self.torch = sgl, page_size, torch
        self.name = f"sglang {sgl.version}"
        if page_size == 1:
            self.alloc = sgl.TokenToKVPoolAllocator(capacity, torch.int64, "cpu", None, False)
        else:
            self.alloc = sgl.PagedTokenToKVPoolAllocator(
                capacity, page_size, torch.int64, "cpu", None, False
            )
        params = sgl.CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=self.alloc,
            page_size=page_size,
        )
        self.tree = sgl.RadixCache(params)
        self.evicted = 0

    def prepare(self, req: Request) -> Any:
        """Its scheduler receives token ids as array("q"), converted upstream."""
        return array("q", req.prompt), array("q", req.output)

    def serve(self, prepared: Any) -> int:
        sgl, ps, alloc, tree = self.sgl, self.page_size, self.alloc, self.tree
        prompt, output = prepared
        ids = prompt + output
        match = tree.match_prefix(sgl.MatchPrefixParams(key=sgl.RadixKey(ids[: len(prompt) - 1])))
        node = match.last_device_node
        prefix = tree.path_device_indices(node)
        tree.inc_lock_ref(node)
        need = -(-len(ids) // ps) * ps - len(prefix)
        if need > alloc.available_size():
            evicted = tree.evict(sgl.EvictParams(num_tokens=need - alloc.available_size()))
            self.evicted += evicted.num_tokens_evicted
        fresh = alloc.alloc(need)
        assert fresh is not None, "SGLang's allocator could not serve a request that fits"
        values = self.torch.cat((prefix, fresh))
        key = sgl.RadixKey(ids).page_aligned(ps)
        inserted = tree.insert(sgl.InsertParams(key=key, value=values[: len(key)]))
        # as its _insert_cache does: the duplicates past the match, then the partial last page
        alloc.free_segment(values[len(prefix) : inserted.prefix_len], start_pos=len(prefix))
        alloc.free_segment(values[len(key) :], start_pos=len(key))
        tree.dec_lock_ref(node)
        return match.device_prefix_len

    def evicted_tokens(self) -> int:
        return self.evicted

    def pool_bytes_per_page(self) -> float:
        """Its free list holds one int64 per free page (a tensor), at most one per page."""
        return float(self.alloc.free_pages.element_size())

    def held_tensor_bytes(self) -> int:
        total = self.alloc.free_pages.numel() * 8
        stack = [self.tree.root_node]
        while stack:
            node = stack.pop()
            if node.value is not None and hasattr(node.value, "numel"):
                total += node.value.numel() * node.value.element_size()
            stack.extend(node.children.values())
        return total


def serve_all(cache: Any, requests: list[Request]) -> Run:
    prepared = [cache.prepare(req) for req in requests]
    prompts = sum(len(req.prompt) for req in requests)
    gc.collect()
    reused = 0
    began = time.perf_counter()
    for one in prepared:
        reused += cache.serve(one)
    wall = time.perf_counter() - began
    return Run(len(requests) / wall, reused / prompts, cache.evicted_tokens())


def peak_bytes(make: Callable[[], Any], requests: list[Request]) -> tuple[int, float]:
    """(peak bytes of the run, pool bookkeeping bytes per page), untimed."""
    gc.collect()
    tracemalloc.start()
    cache = make()
    for req in requests:
        cache.serve(cache.prepare(req))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak + cache.held_tensor_bytes(), cache.pool_bytes_per_page()


def compare(
    sgl: sglang_radix.SGLang,
    requests: list[Request],
    distinct: int,
    fraction: float,
    page_size: int,
    rounds: int,
    memory: bool,
) -> dict[str, Any]:
    capacity = capacity_tokens(requests, distinct, fraction, page_size)
    makers: dict[str, Callable[[], Any]] = {
        "radixmesh": lambda: Radixmesh(capacity, page_size),
        "sglang": lambda: SGLangCache(sgl, capacity, page_size),
    }
    runs: dict[str, list[Run]] = {name: [] for name in makers}
    for r in range(rounds):  # alternate, and swap who goes first each round
        order = list(makers) if r % 2 == 0 else list(reversed(makers))
        for name in order:
            runs[name].append(serve_all(makers[name](), requests))
    ratios = [
        ours.requests_per_s / theirs.requests_per_s
        for ours, theirs in zip(runs["radixmesh"], runs["sglang"], strict=True)
    ]
    row: dict[str, Any] = {
        "capacity_fraction": fraction,
        "capacity_tokens": capacity,
        "page_size": page_size,
        "requests": len(requests),
        "rounds": rounds,
        "ratio_median": sorted(ratios)[len(ratios) // 2],
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }
    for name, done in runs.items():
        rates = sorted(run.requests_per_s for run in done)
        row[name] = {
            "requests_per_s": rates[len(rates) // 2],
            "requests_per_s_all": [run.requests_per_s for run in done],
            "hit_rate": done[0].hit_rate,
            "evicted_tokens": done[0].evicted_tokens,
        }
        if memory:
            peak, pool = peak_bytes(makers[name], requests)
            row[name]["peak_bytes"] = peak
            row[name]["pool_bytes_per_page"] = pool
    return row


def table(rows: list[dict[str, Any]]) -> Table:
    out = Table(title="radixmesh / SGLang requests per second (median, min-max over rounds)")
    for column in ("workload", "capacity", "page", "radixmesh req/s", "sglang req/s", "ratio"):
        out.add_column(column, justify="right")
    for column in ("hit (ours / sglang)", "peak MB (ours / sglang)", "pool B/page"):
        out.add_column(column, justify="right")
    for row in rows:
        ours, theirs = row["radixmesh"], row["sglang"]
        peak = pool = "-"
        if "peak_bytes" in ours:
            peak = f"{ours['peak_bytes'] / 2**20:.1f} / {theirs['peak_bytes'] / 2**20:.1f}"
            pool = f"{ours['pool_bytes_per_page']:.0f} / {theirs['pool_bytes_per_page']:.0f}"
        out.add_row(
            row["workload"],
            f"{row['capacity_fraction']:.0%}",
            str(row["page_size"]),
            f"{ours['requests_per_s']:,.0f}",
            f"{theirs['requests_per_s']:,.0f}",
            f"{row['ratio_median']:.2f}x ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})",
            f"{ours['hit_rate']:.3f} / {theirs['hit_rate']:.3f}",
            peak,
            pool,
        )
    return out


def run(
    names: list[str],
    rounds: int,
    memory: bool,
    output: Path | None,
    wheel_dir: Path | None,
    scale: float = 1.0,
) -> int:
    """Every (workload, capacity, page size) cell; a JSON line each on stdout. 0, or 2 offline."""
    with tempfile.TemporaryDirectory(prefix="radixmesh-sglang-") as tmp:
        wheel = sglang_radix.fetch_wheel(wheel_dir or Path(tmp))
        if wheel is None:
            console.print(
                f"[yellow]skipped: pip could not download sglang=={sglang_radix.SGLANG_VERSION} "
                "(offline?); nothing was compared[/]"
            )
            return 2
        sgl = sglang_radix.load(wheel, Path(tmp) / "src")
        rows = []
        cells = [(n, f, p) for n in names for f in CAPACITIES for p in PAGE_SIZES]
        with progress_bar(console=console, transient=True) as progress:
            task = progress.add_task("cells", total=len(cells))
            streams: dict[str, tuple[list[Request], int]] = {}
            for name, fraction, page_size in cells:
                if name not in streams:
                    requests = WORKLOADS[name]()
                    requests = requests[: max(1, int(len(requests) * scale))]
                    streams[name] = requests, distinct_tokens(requests)
                progress.update(task, description=f"{name}, {fraction:.0%}, page {page_size}")
                row = {"workload": name}
                row |= compare(sgl, *streams[name], fraction, page_size, rounds, memory)
                rows.append(row)
                print(json.dumps(row), flush=True)
                progress.advance(task)
    if output is not None:
        output.write_text("".join(json.dumps(row) + "\n" for row in rows))
    console.print(table(rows))
    return 0
