"""What a restart costs with the cache persisted: TTFT of a conversation's next turn cold, warm
and after a restart, and the time to save and load a big cache.

    turn 1: a ~1k-token conversation is served (the engine caches it)
    turn 2: the conversation plus a question, measured three ways:
      cold           a fresh engine, nothing cached
      warm           the engine that served turn 1 (a device hit)
      after restart  turn 1's engine stopped (it saves its cache, as on SIGTERM's drain), a new
                     engine loads the directory, then turn 2 (the first request it sees)
      from disk      turn 1 saved, then cleared from every tier of the running engine: turn 2
                     reads it back from disk on demand (the file read is inside its TTFT)

and, on the tiny model, the seconds to save and to load `--cache-tokens` cached tokens (a tree of
conversations sharing a system prompt, through the same `KvStore` the engine uses).

`--stall` measures what a disk hit costs the others: the engine runs on its thread, one request
decodes, and turn 2 arrives while turn 1 is on disk alone (saved, then cleared from every tier).
Reported: the longest gap between two of the decoding request's tokens from turn 2's arrival to
its first token, against the median gap before it arrived, and turn 2's TTFT. Uses the engine's
public calls only, so the same script measures a checkout from before disk reads moved off the
engine thread (PYTHONPATH=that checkout).

Medians of --repeats. Prints a table and one JSON object (and --output).
Run: `python benchmarks/restart_bench.py [--model default] [--prompt-len 1024]`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.progress import track
from rich.table import Table

from benchmarks.prefill_bench import first_token_seconds
from worker.engine import Engine, EngineConfig
from worker.kv_persistence import KvStore
from worker.loader import load_model
from worker.model import CausalLM
from worker.request import GenerateRequest, RequestOutput
from worker.sampling_params import SamplingParams
from worker.tiny_model import TINY_CONFIG, tiny_model

console = Console(stderr=True)


def _config(length: int, persist: Path | None, **extra: object) -> EngineConfig:
    base: dict[str, object] = dict(
        num_pages=2 * length // 16 + 64, page_size=16, max_running=4,
        token_budget=length + 64, max_prefill_chunk=length + 64, max_model_len=length + 256,
        persist_dir=None if persist is None else str(persist), persist_interval_s=0.0,
    )  # fmt: skip
    base.update(extra)
    return EngineConfig(**base)  # type: ignore[arg-type]


def restart_ttft(model: CausalLM, length: int, repeats: int, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    rows: dict[str, list[float]] = {"cold": [], "warm": [], "after restart": [], "from disk": []}
    cached: dict[str, int] = {}
    save_s, load_s = [], []
    for r in track(range(repeats), description="restart TTFT", console=console):
        turn1 = [rng.randrange(1, vocab) for _ in range(length)]
        turn2 = [*turn1, *(rng.randrange(1, vocab) for _ in range(24))]
        cold = Engine(model, None, _config(len(turn2), None))
        first_token_seconds(cold, [rng.randrange(1, vocab) for _ in range(32)], "warmup")
        seconds, cached["cold"] = first_token_seconds(cold, turn2, f"cold{r}")
        rows["cold"].append(seconds)
        warm = Engine(model, None, _config(len(turn2), None))
        first_token_seconds(warm, turn1, f"turn1-{r}")
        seconds, cached["warm"] = first_token_seconds(warm, turn2, f"warm{r}")
        rows["warm"].append(seconds)
        with tempfile.TemporaryDirectory(prefix="radixmesh-restart-") as tmp:
            first = Engine(model, None, _config(len(turn2), Path(tmp)))
            first_token_seconds(first, turn1, f"turn1-{r}")
            began = time.perf_counter()
            first.stop()  # saves, as a drain does
            save_s.append(time.perf_counter() - began)
            began = time.perf_counter()
            second = Engine(model, None, _config(len(turn2), Path(tmp)))
            load_s.append(time.perf_counter() - began)
            seconds, cached["after restart"] = first_token_seconds(second, turn2, f"restart{r}")
            rows["after restart"].append(seconds)
        with tempfile.TemporaryDirectory(prefix="radixmesh-disk-") as tmp:
            disk = Engine(model, None, _config(len(turn2), Path(tmp)))
            first_token_seconds(disk, turn1, f"turn1-disk-{r}")
            assert disk.store is not None
            disk.store.save(disk)  # as the background saver does while serving
            disk.cache.tree.clear()  # gone from every tier; only the files remain
            seconds, cached["from disk"] = first_token_seconds(disk, turn2, f"disk{r}")
            rows["from disk"].append(seconds)
    medians = {name: statistics.median(times) for name, times in rows.items()}
    return {
        "prompt_tokens": length,
        "ttft_ms": {name: 1000 * s for name, s in medians.items()},
        "cached_tokens": cached,
        "restart_over_warm": medians["after restart"] / medians["warm"],
        "restart_over_cold": medians["after restart"] / medians["cold"],
        "disk_over_cold": medians["from disk"] / medians["cold"],
        "save_ms": 1000 * statistics.median(save_s),
        "load_ms": 1000 * statistics.median(load_s),
    }


def disk_stall(model: CausalLM, length: int, repeats: int, seed: int) -> dict:
    """Gaps between a decoding request's tokens while another request's disk hit is read."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    runs = []
    for r in track(range(repeats), description="disk hit stall", console=console):
        turn1 = [rng.randrange(1, vocab) for _ in range(length)]
        turn2 = [*turn1, *(rng.randrange(1, vocab) for _ in range(24))]
        other = [rng.randrange(1, vocab) for _ in range(32)]
        with tempfile.TemporaryDirectory(prefix="radixmesh-stall-") as tmp:
            engine = Engine(model, None, _config(len(turn2) + 256, Path(tmp)))
            runs.append(_stall_once(engine, turn1, turn2, other, str(r)))
    return {
        "prompt_tokens": length,
        "cached_tokens": runs[-1]["cached"],
        "median_gap_ms": 1000 * statistics.median(run["before"] for run in runs),
        "longest_gap_ms": 1000 * statistics.median(run["longest"] for run in runs),
        "longest_gaps_ms": [round(1000 * run["longest"], 1) for run in runs],
        "hit_ttft_ms": 1000 * statistics.median(run["ttft"] for run in runs),
    }


def _stall_once(
    engine: Engine, turn1: list[int], turn2: list[int], other: list[int], tag: str
) -> dict:
    first_token_seconds(engine, turn1, f"turn1-{tag}")
    first_token_seconds(engine, other, f"warm-{tag}")
    assert engine.store is not None
    engine.store.save(engine)
    engine.cache.tree.clear()  # turn 1 is on disk alone
    engine.runner.copy_pages(engine.cache.take_tier_copies())
    stamps: list[float] = []  # the decoding request's tokens
    answer: list[tuple[float, RequestOutput]] = []  # the disk hit's outputs

    def decoded(output: RequestOutput) -> None:
        if output.token_ids:
            stamps.append(time.perf_counter())

    decode = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.start()
    try:
        engine.submit(GenerateRequest(f"decoding{tag}", tuple(other), sampling=decode), decoded)
        _wait(lambda: len(stamps) >= 12)
        arrived = time.perf_counter()
        hit = GenerateRequest(f"hit{tag}", tuple(turn2), sampling=one)
        engine.submit(hit, lambda o: answer.append((time.perf_counter(), o)))
        _wait(lambda: any(o.finished for _, o in answer))
        _wait(lambda: len(stamps) >= 160)
    finally:
        engine.stop()
    answered = answer[0][0]
    gaps = [(a, b) for a, b in itertools.pairwise(stamps)]
    return {
        "before": statistics.median(b - a for a, b in gaps if b < arrived),
        "longest": max(b - a for a, b in gaps if b > arrived and a < answered),
        "ttft": answered - arrived,
        "cached": next(o for _, o in answer if o.finished).cached_prompt_tokens,
    }


def _wait(done: Callable[[], bool], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("the engine did not get there in time")
        time.sleep(0.001)


def save_load(tokens: int, conversation: int, repeats: int, seed: int) -> dict:
    """Seconds to save and load `tokens` cached tokens of the tiny model."""
    model = tiny_model(TINY_CONFIG, seed=seed)
    rng = random.Random(seed)
    ps = 16
    system = [rng.randrange(1, TINY_CONFIG.vocab_size) for _ in range(256)]
    count = max(1, (tokens - len(system)) // (conversation - len(system)))
    config = _config(
        conversation, None, num_pages=tokens // ps + 2 * count + 64, max_model_len=None
    )
    saves, loads, nbytes, nodes = [], [], 0, 0
    for _ in track(range(repeats), description="save / load", console=console):
        with tempfile.TemporaryDirectory(prefix="radixmesh-saveload-") as tmp:
            engine = Engine(model, None, config)
            tree = engine.cache.tree
            for _ in range(count):  # cached as a prefill would leave them, without computing
                tail = [rng.randrange(1, TINY_CONFIG.vocab_size) for _ in range(conversation)]
                keys = (system + tail)[: conversation // ps * ps]
                match = tree.match(keys)
                fresh = engine.cache.pool.allocate(len(keys) // ps - len(match.pages))
                tree.insert(keys, match.pages + fresh)
            cached = tree.cached_pages * ps
            store = KvStore(Path(tmp), 1 << 40)
            began = time.perf_counter()
            nodes = store.save(engine)
            saves.append(time.perf_counter() - began)
            nbytes = sum(p.stat().st_size for p in Path(tmp).iterdir())
            began = time.perf_counter()
            fresh_engine = Engine(model, None, config)
            report = KvStore(Path(tmp), 1 << 40).load(fresh_engine)
            loads.append(time.perf_counter() - began)
            assert report.positions == cached, (report, cached)
    return {
        "cached_tokens": cached,
        "nodes": nodes,
        "bytes": nbytes,
        "save_s": statistics.median(saves),
        "load_s": statistics.median(loads),
    }


def report(result: dict) -> Table:
    table = Table(title="restart with a persisted cache")
    table.add_column("measure")
    table.add_column("value", justify="right")
    if "restart" in result:
        r = result["restart"]
        for name, ms in r["ttft_ms"].items():
            table.add_row(f"TTFT {name} ({r['cached_tokens'][name]} cached)", f"{ms:.1f} ms")
        table.add_row("after restart / warm", f"{r['restart_over_warm']:.2f}")
        table.add_row("after restart / cold", f"{r['restart_over_cold']:.2f}")
        table.add_row("from disk / cold", f"{r['disk_over_cold']:.2f}")
        table.add_row(
            f"save / load of the {r['prompt_tokens']}-token turn",
            f"{r['save_ms']:.1f} / {r['load_ms']:.1f} ms",
        )
    if "stall" in result:
        st = result["stall"]
        table.add_row(
            f"a token's gap while a {st['prompt_tokens']}-token disk hit is read "
            f"({st['cached_tokens']} cached): median before / longest",
            f"{st['median_gap_ms']:.1f} / {st['longest_gap_ms']:.1f} ms",
        )
        table.add_row("that disk hit's TTFT", f"{st['hit_ttft_ms']:.1f} ms")
    if "save_load" in result:
        s = result["save_load"]
        table.add_row(
            f"save / load {s['cached_tokens']:,} tokens (tiny model, {s['nodes']} nodes, "
            f"{s['bytes'] / 2**20:.0f} MiB)",
            f"{s['save_s']:.2f} / {s['load_s']:.2f} s",
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M) or 'tiny'")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-tokens", type=int, default=1_000_000)
    parser.add_argument("--conversation", type=int, default=2048, help="tokens per cached one")
    parser.add_argument("--skip-restart", action="store_true")
    parser.add_argument("--skip-save-load", action="store_true")
    parser.add_argument("--stall", action="store_true", help="also measure a disk hit's stall")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    result: dict = {}
    if not args.skip_restart:
        if args.model == "tiny":
            model = tiny_model(TINY_CONFIG, seed=args.seed)
        else:
            model = load_model(args.model).model
        result["restart"] = restart_ttft(model, args.prompt_len, args.repeats, args.seed)
    if args.stall:
        stall_model = tiny_model(TINY_CONFIG, seed=args.seed) if args.model == "tiny" else None
        if stall_model is None:
            stall_model = load_model(args.model).model
        result["stall"] = disk_stall(stall_model, args.prompt_len, args.repeats, args.seed)
    if not args.skip_save_load:
        result["save_load"] = save_load(
            args.cache_tokens, args.conversation, args.repeats, args.seed
        )
    print(json.dumps(result))
    if args.output is not None:
        args.output.write_text(json.dumps(result) + "\n")
    Console(width=None if sys.stdout.isatty() else 120).print(report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
