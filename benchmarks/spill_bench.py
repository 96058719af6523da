"""Conversations bigger than both tiers: what a disk tier that keeps what eviction drops
(worker/disk_spill.py, `persist_evicted`) gives each turn, against the same tiers without it
and against a device that holds everything, in the same run.

    C conversations take turns round robin; each turn sends the whole history plus a new user
    message of U tokens and decodes G tokens, which join the history. The device and host
    tiers hold less than the conversations together, so a history is evicted before its next
    turn comes (LRU, as the multi-turn workload of cache_bench.py shows: 0.13 hit rate with
    device 5 % + host 8x against 0.83 unbounded).

Three engines, each on its own thread as a worker runs it (the background saver's thread
writes what eviction drops while the others are served):
  unbounded     a device tier that holds every conversation
  tiers         device + host tiers, persistence on, `persist_evicted` off (the disk holds
                only what the saves write: none here, they are 10 minutes apart)
  tiers + disk  the same with `persist_evicted` on

A turn starts when the one before it ends (`--think-s` adds a pause, a user's think time: on
the tiny model turns take milliseconds, less than the saver's pause between two listings).
Reported per engine: prompt tokens served from cache (and from disk; and those found on disk
but recomputed, which the worker priced faster: worker/tier_costs.py), TTFT mean and p50 of
turns after the first, the whole run's seconds, pages spilled. Prints a table and one JSON
object (and --output).
Run: `python benchmarks/spill_bench.py [--model default|tiny] [--conversations 6] [--turns 4]`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from cluster.progress import progress_bar
from worker.engine import Engine, EngineConfig
from worker.loader import load_model
from worker.model import CausalLM
from worker.request import GenerateRequest, RequestOutput
from worker.sampling_params import SamplingParams
from worker.tiny_model import TINY_CONFIG, tiny_model

console = Console(stderr=True)
PAGE = 16
MODES = ("unbounded", "tiers", "tiers + disk")


def conversations(
    count: int, turns: int, user: int, vocab: int, seed: int
) -> list[list[list[int]]]:
    """Each conversation's user messages, token ids drawn at random."""
    rng = random.Random(seed)
    return [
        [[rng.randrange(1, vocab) for _ in range(user)] for _ in range(turns)] for _ in range(count)
    ]


def _turn(
    engine: Engine, prompt: list[int], decode: int, request_id: str
) -> tuple[list[int], int, float]:
    """Serve one turn on the running engine: (tokens decoded, cached prompt tokens, TTFT s)."""
    outputs: list[RequestOutput] = []
    done = threading.Event()
    first: list[float] = []

    def sink(output: RequestOutput) -> None:
        if not first:
            first.append(time.perf_counter())
        outputs.append(output)
        if output.finished:
            done.set()

    sampling = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)
    began = time.perf_counter()
    engine.submit(GenerateRequest(request_id, tuple(prompt), sampling=sampling), sink)
    if not done.wait(600):
        raise TimeoutError(f"{request_id} did not finish in 600 s")
    tokens = [t for o in outputs for t in o.token_ids]
    return tokens, outputs[-1].cached_prompt_tokens, first[0] - began


def _config(mode: str, args: argparse.Namespace, directory: Path) -> EngineConfig:
    longest = args.turns * (args.user + args.decode) + 64
    small = mode != "unbounded"
    pages = args.device_pages if small else 2 * args.conversations * longest // PAGE + 64
    return EngineConfig(
        num_pages=pages,
        page_size=PAGE,
        max_running=4,
        token_budget=512,
        max_prefill_chunk=512,
        max_model_len=longest + 64,
        host_pages=args.host_pages if small else 0,
        persist_dir=str(directory) if small else None,
        persist_interval_s=600.0,
        persist_evicted=mode == "tiers + disk",
    )


def run(model: CausalLM, mode: str, args: argparse.Namespace, progress: Progress) -> dict:
    talks = conversations(
        args.conversations, args.turns, args.user, model.config.vocab_size, args.seed
    )
    histories: list[list[int]] = [[] for _ in talks]
    rows: list[tuple[int, int, int, float]] = []  # turn, prompt tokens, cached, ttft
    task = progress.add_task(mode, total=args.turns * args.conversations)
    with tempfile.TemporaryDirectory(prefix="radixmesh-spill-") as tmp:
        engine = Engine(model, None, _config(mode, args, Path(tmp)), source="w0")
        engine.start()
        began = time.perf_counter()
        try:
            _turn(engine, [1, 2, 3, 4], 2, "warmup")
            for turn in range(args.turns):
                for c, talk in enumerate(talks):
                    prompt = [*histories[c], *talk[turn]]
                    tokens, cached, ttft = _turn(engine, prompt, args.decode, f"c{c}t{turn}")
                    histories[c] = [*prompt, *tokens]
                    rows.append((turn, len(prompt), cached, ttft))
                    time.sleep(args.think_s)
                    progress.advance(task)
            seconds = time.perf_counter() - began
            stats = engine.stats()
        finally:
            engine.stop()
    later = [r for r in rows if r[0] > 0]
    prompt_tokens = sum(r[1] for r in later)
    cached = sum(r[2] for r in later)
    ttfts = [r[3] for r in later]
    return {
        "mode": mode,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "disk_hit_tokens": stats.disk_hit_tokens,
        "disk_skipped_tokens": stats.disk_skipped_tokens,
        "spilled_pages": stats.disk_spilled_pages,
        "spill_skipped_pages": stats.disk_spill_skipped_pages,
        "ttft_mean_ms": 1000 * statistics.fmean(ttfts) if ttfts else 0.0,
        "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else 0.0,
        "seconds": seconds,
    }


def report(result: dict) -> Table:
    table = Table(title="turns after the first: prompt tokens from cache, TTFT")
    columns = ("engine", "hit rate", "from disk / priced out", "TTFT mean", "TTFT p50", "run")
    for column in (*columns, "spilled"):
        table.add_column(column, justify="right" if column != "engine" else "left")
    for row in result["runs"]:
        table.add_row(
            row["mode"],
            f"{row['hit_rate']:.3f}",
            f"{row['disk_hit_tokens']:,} / {row['disk_skipped_tokens']:,}",
            f"{row['ttft_mean_ms']:.0f} ms",
            f"{row['ttft_p50_ms']:.0f} ms",
            f"{row['seconds']:.1f} s",
            f"{row['spilled_pages']:,} pages",
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M) or 'tiny'")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--user", type=int, default=128, help="tokens of each user message")
    parser.add_argument("--decode", type=int, default=16, help="tokens decoded each turn")
    parser.add_argument("--device-pages", type=int, default=48, help="of 16 positions")
    parser.add_argument("--host-pages", type=int, default=64, help="of 16 positions")
    parser.add_argument("--think-s", type=float, default=0.0, help="pause after each turn")
    parser.add_argument("--rounds", type=int, default=1, help="each engine this many times")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.model == "tiny":
        model = tiny_model(TINY_CONFIG, seed=args.seed)
    else:
        model = load_model(args.model).model
    runs = []
    with progress_bar(console=console, transient=True) as progress:
        for _ in range(args.rounds):  # the engines alternate: each round runs every one
            runs.extend(run(model, mode, args, progress) for mode in args.modes)
    result = {"workload": {k: v for k, v in vars(args).items() if k != "output"}, "runs": runs}
    result["workload"]["model"] = args.model
    print(json.dumps(result, default=str))
    if args.output is not None:
        args.output.write_text(json.dumps(result, default=str) + "\n")
    Console(width=None if sys.stdout.isatty() else 120).print(report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
