"""What reading a prompt's KV from another worker saves: time to first token on a worker told
(`WorkerGenerateRequest.kv_peer`) that another holds the prompt, against recomputing it.

Two engines in this process share one model's weights, each behind its own worker gRPC server
on loopback (served as worker/actor.py serves one). Per case (a prompt of P tokens) and round,
worker A computes a fresh random prompt (max_tokens 1), so it caches it; then worker B serves
that prompt plus `--suffix` more tokens (max_tokens 1, greedy) two ways, which goes first
alternating by round, B's cache cleared (ClearCache) before each; and A serves it once, the
floor a read can at best reach:

    recompute   no kv_peer: B computes every position
    peer        kv_peer = A with positions P: B reads A's whole pages over ReadKv
                (worker/peer_reads.py) when its learned rates price the read faster than
                recomputing (worker/tier_costs.py; until B has seen `min_passes` passes it
                always reads), else recomputes
    held        on A, which holds the prompt: only the suffix is computed (no read)

Reported per case and way: TTFT as the gRPC client sees it, median and min-max over rounds; the
speed-up of the medians; the positions B found cached (the response's cached_prompt_tokens) and
read from A (B's stats: peer_read_tokens), the KV bytes that moved, positions priced out
(peer_skipped_tokens) and failed reads; whether both ways drew the same first token. A warm-up
round of the smallest case (not reported) comes first. One JSON line per measurement, then a
table.

Run: `python benchmarks/peer_kv_bench.py [--model default|tiny] [--prompt-tokens 512 1024 2048]
[--rounds 3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from cluster.progress import progress_bar
from protos.radixmesh.v1 import serving_pb2, worker_pb2, worker_pb2_grpc
from worker.engine import Engine, EngineConfig
from worker.grpc_server import GrpcServer, ServerLimits, internal_message_bytes, start_server
from worker.kv_persistence import StoreIdentity
from worker.loader import load_model
from worker.model import CausalLM
from worker.servicer import WorkerServicer
from worker.tiny_model import TINY_CONFIG, tiny_model

console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)
WAYS = ("recompute", "peer")
"""B's ways, alternated; A's "held" is measured before them."""
ALL_WAYS = (*WAYS, "held")
PAGE = 16
T = TypeVar("T")


@dataclass
class Served:
    """An engine behind its own worker gRPC server, and a client's stub to it."""

    name: str
    engine: Engine
    server: GrpcServer
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    async def on_engine(self, function: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.engine.call(function))


@contextlib.asynccontextmanager
async def serve(engine: Engine, name: str) -> AsyncIterator[Served]:
    """`engine` started behind a worker gRPC server on loopback (tests/worker/helpers.py's
    `served_at`, with the message limit a worker's server has: worker/actor.py)."""
    engine.start()
    servicer = WorkerServicer(engine, name)
    register = [(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "radixmesh.v1.Worker")]
    config = engine.config
    limits = ServerLimits(internal_message_bytes(config.max_images, config.max_image_bytes))
    server = await start_server(register, "127.0.0.1", 0, limits)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Served(name, engine, server, channel, worker_pb2_grpc.WorkerStub(channel))
    finally:
        await channel.close()
        await server.server.stop(grace=0)
        engine.stop()


def engine_config(longest: int, revision: str) -> EngineConfig:
    """The cluster's engine defaults (cluster/config.py EngineSection: pages of 16, passes of at
    most 512 tokens), a pool that holds two of the longest prompts, room for it."""
    return EngineConfig(
        num_pages=2 * longest // PAGE + 16,
        page_size=PAGE,
        max_running=8,
        token_budget=512,
        max_prefill_chunk=512,
        max_model_len=longest + PAGE,
        model_revision=revision,
    )


async def first_token(
    stub: worker_pb2_grpc.WorkerStub,
    request_id: str,
    tokens: list[int],
    peer: worker_pb2.KvPeer | None = None,
) -> tuple[float, int, int]:
    """(seconds to the first token, that token, cached_prompt_tokens) of a greedy request for
    one token."""
    sampling = serving_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    request = worker_pb2.WorkerGenerateRequest(
        request_id=request_id, token_ids=tokens, sampling=sampling, kv_peer=peer
    )
    began = time.perf_counter()
    async for response in stub.Generate(request, timeout=600):
        if response.token_ids:
            return time.perf_counter() - began, response.token_ids[0], response.cached_prompt_tokens
    raise RuntimeError(f"{request_id} ended without a token")


async def clear(served: Served) -> None:
    """Empty the worker's cache; ClearCache refuses while a request still runs (the last
    one's end may reach the engine after its answer reached us), so try again shortly."""
    for _ in range(200):
        try:
            await served.stub.ClearCache(serving_pb2.ClearCachesRequest(), timeout=30)
            return
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            await asyncio.sleep(0.01)
    raise RuntimeError(f"{served.name}'s cache never went idle to clear")


def peer_counts(engine: Engine) -> tuple[int, int, int]:
    """(peer_read_tokens, peer_skipped_tokens, peer_read_failures): engine thread."""
    stats = engine.stats()
    return stats.peer_read_tokens, stats.peer_skipped_tokens, stats.peer_read_failures


async def measure(
    served: Served, way: str, tokens: list[int], peer: worker_pb2.KvPeer, request_id: str
) -> dict[str, Any]:
    """One request on `served` (B, its cache emptied first; A for "held"): `way` "peer" names
    A as its kv_peer."""
    if way != "held":
        await clear(served)
    before = await served.on_engine(lambda: peer_counts(served.engine))
    told = peer if way == "peer" else None
    seconds, token, cached = await first_token(served.stub, request_id, tokens, told)
    after = await served.on_engine(lambda: peer_counts(served.engine))
    read, skipped, failed = (x - y for x, y in zip(after, before, strict=True))
    return {
        "way": way,
        "worker": served.name,
        "ttft_s": seconds,
        "first_token": token,
        "cached_prompt_tokens": cached,
        "peer_read_tokens": read,
        "peer_skipped_tokens": skipped,
        "peer_read_failures": failed,
    }


def kv_bytes_per_position(engine: Engine) -> int:
    """K and V of one position, every layer (what a read moves per position)."""
    identity = StoreIdentity.of(engine)
    item = engine.runner.kv[0][0].element_size()
    return 2 * identity.num_layers * identity.kv_heads * identity.head_dim * item


async def one_round(
    a: Served, b: Served, prompt_tokens: int, args: argparse.Namespace, round_: int
) -> list[dict[str, Any]]:
    """A computes a fresh prompt and serves it with the suffix (held); B serves that both
    ways."""
    rng = random.Random(f"{args.seed}-{prompt_tokens}-{round_}")
    vocab = a.engine.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
    tokens = prompt + [rng.randrange(3, vocab) for _ in range(args.suffix)]
    a_seconds, _, _ = await first_token(a.stub, f"a-{prompt_tokens}-{round_}", prompt)
    peer = worker_pb2.KvPeer(worker=a.name, address=a.address, positions=prompt_tokens)
    ways = WAYS if round_ % 2 == 0 else WAYS[::-1]
    reports = []
    for way in ("held", *ways):
        served = a if way == "held" else b
        report = await measure(served, way, tokens, peer, f"{prompt_tokens}-{round_}-{way}")
        report |= {
            "prompt_tokens": prompt_tokens,
            "suffix_tokens": args.suffix,
            "round": round_,
            "a_prompt_ttft_s": a_seconds,
            "kv_bytes_read": report["peer_read_tokens"] * kv_bytes_per_position(b.engine),
        }
        reports.append(report)
    return reports


def build_model(name: str, seed: int) -> tuple[CausalLM, str]:
    """The model's weights (loaded once, both engines share them) and its revision."""
    if name == "tiny":
        return tiny_model(TINY_CONFIG, seed=seed), "tiny"
    loaded = load_model(name)
    return loaded.model, loaded.revision


async def run(args: argparse.Namespace, progress: Progress) -> list[dict[str, Any]]:
    model, revision = build_model(args.model, args.seed)
    config = engine_config(max(args.prompt_tokens) + args.suffix, revision)
    engines = [Engine(model, None, config, source=name) for name in ("a", "b")]
    reports: list[dict[str, Any]] = []
    async with serve(engines[0], "a") as a, serve(engines[1], "b") as b:
        task = progress.add_task("peer reads", total=args.rounds * len(args.prompt_tokens))
        await one_round(a, b, min(args.prompt_tokens), args, -1)  # warm-up, not reported
        for prompt_tokens in args.prompt_tokens:
            for round_ in range(args.rounds):
                for report in await one_round(a, b, prompt_tokens, args, round_):
                    print(json.dumps(report), flush=True)
                    reports.append(report)
                progress.advance(task)
    return reports


def _cell(values: list[float]) -> str:
    ms = [1000 * v for v in values]
    form = ".0f" if min(ms) >= 100 else ".1f"
    return f"{statistics.median(ms):{form}} ({min(ms):{form}}-{max(ms):{form}})"


def _span(values: list[int]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"


def _size(size: float) -> str:
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"


def case_summary(reports: list[dict[str, Any]], prompt_tokens: int) -> dict[str, Any]:
    """One case's numbers over its rounds."""
    mine = [r for r in reports if r["prompt_tokens"] == prompt_tokens]
    by_way = {w: [r for r in mine if r["way"] == w] for w in ALL_WAYS}
    rounds = sorted({r["round"] for r in mine})
    firsts = {(r["round"], r["way"]): r["first_token"] for r in mine}
    peer = by_way["peer"]
    return {
        "ttft": {w: [r["ttft_s"] for r in by_way[w]] for w in ALL_WAYS},
        "same_token": all(len({firsts[(n, w)] for w in ALL_WAYS}) == 1 for n in rounds),
        "cached": [r["cached_prompt_tokens"] for r in peer],
        "read": [r["peer_read_tokens"] for r in peer],
        "bytes": statistics.median(r["kv_bytes_read"] for r in peer),
        "skipped": sum(r["peer_skipped_tokens"] for r in peer),
        "failed": sum(r["peer_read_failures"] for r in peer),
        "recomputed_cached": max(r["cached_prompt_tokens"] for r in by_way["recompute"]),
        "held_cached": min(r["cached_prompt_tokens"] for r in by_way["held"]),
    }


def table(reports: list[dict[str, Any]], prompt_tokens: list[int]) -> Table:
    out = Table(title="TTFT, ms (on B; held: on A): median (min-max) over rounds")
    columns = ("prompt", "recompute", "peer", "held (A)", "speed-up", "B cached / read from A")
    for column in (*columns, "KV moved", "priced out / failed", "same token"):
        out.add_column(column, justify="right")
    for p in prompt_tokens:
        s = case_summary(reports, p)
        speedup = statistics.median(s["ttft"]["recompute"]) / statistics.median(s["ttft"]["peer"])
        out.add_row(
            f"{p} + {reports[0]['suffix_tokens']}",
            _cell(s["ttft"]["recompute"]),
            _cell(s["ttft"]["peer"]),
            _cell(s["ttft"]["held"]),
            f"{speedup:.1f}x",
            f"{_span(s['cached'])} / {_span(s['read'])}",
            _size(s["bytes"]),
            f"{s['skipped']} / {s['failed']}",
            "yes" if s["same_token"] else "[bold red]NO[/]",
        )
    return out


def warnings(reports: list[dict[str, Any]], prompt_tokens: list[int]) -> list[str]:
    """What makes a case's numbers not what they claim to be."""
    lines = []
    for p in prompt_tokens:
        s = case_summary(reports, p)
        if not s["same_token"]:
            lines.append(f"P={p}: the ways drew different first tokens (see the JSON lines)")
        whole = p // PAGE * PAGE
        short = [r for r in s["read"] if r < whole]
        if short:
            lines.append(
                f"P={p}: {len(short)} peer measurement(s) read fewer than the prompt's {whole} "
                f"positions of whole pages ({short}); priced out {s['skipped']} positions, "
                f"{s['failed']} failed reads: those were recomputed"
            )
        if s["recomputed_cached"]:
            lines.append(f"P={p}: B held {s['recomputed_cached']} positions in a recompute run")
        if s["held_cached"] < whole:
            lines.append(f"P={p}: A held only {s['held_cached']} positions of its prompt")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2), 'tiny' or a path")
    parser.add_argument(
        "--prompt-tokens", type=int, nargs="+", default=[512, 1024, 2048], help="P, per case"
    )
    parser.add_argument("--suffix", type=int, default=16, help="tokens B's prompt adds to P")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.prompt_tokens) < PAGE or args.suffix < 1 or args.rounds < 1:
        parser.error(f"need prompts of a page ({PAGE}) at least, a suffix, a round")
    with progress_bar(console=console, transient=True) as progress:
        reports = asyncio.run(run(args, progress))
    console.print(table(reports, args.prompt_tokens))
    for line in warnings(reports, args.prompt_tokens):
        console.print(f"[bold yellow]warning:[/] {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
