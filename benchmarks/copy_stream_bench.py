"""Issue 15's copy stream on a GPU: what a host-tier hit costs when its promotion overlaps the pass.

For a model shaped like SmolLM2-135M and one shaped like Llama-3.2-1B (bf16, seeded random
weights: timings do not read the values), and for each case "P cached + N new" (a prompt whose
first P tokens are cached, N computed; N = 1 is a hit of all
but the last token), the TTFT of:

- cold: nothing cached;
- device hit: the P tokens cached on the device (the floor: no copy at all);
- host hit, compute stream: the P tokens demoted to the pinned host tier before the request and
  promoted back inside its TTFT, the copies on the compute stream ahead of the pass
  (`EngineConfig(copy_stream=False)`, what the ninth session measured);
- host hit, copy stream: the same with the copies on their own stream, the pass waiting for
  each layer's copies just before that layer (worker/kv_copies.py; `copy_stream_min_bytes=0`);
- host hit, by size: the engine's default, the copy stream only for copies of at least
  `MIN_STREAM_BYTES`.

Every repeat runs the five in that order; medians of --repeats. Beside them: the promoted bytes
and one pinned host-to-device transfer of that many bytes timed alone (CUDA events), the most a
copy stream could hide; "hidden" is the share of the compute-stream promotion's extra time over
the device hit that the copy stream took away. The hits compute the same thing from the same
bytes, so their first tokens must agree exactly; the cold pass computes the prompt in another
shape, so in bf16 a near-tie of a random model may go the other way (reported, not required).
Prints a table on stderr and one JSON object on stdout; exits 2 with a message without CUDA.
Run: `python benchmarks/copy_stream_bench.py [--cases 1024+1 8192+1 8192+1024] [--repeats 5]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.gpu_decode_bench import LLAMA_1B_SHAPED, SMOLLM2_SHAPED
from benchmarks.prefill_bench import bench_engine, first_token
from worker.config import ModelConfig
from worker.engine import Engine
from worker.kv_copies import MIN_STREAM_BYTES
from worker.model import CausalLM
from worker.tiny_model import tiny_model

console = Console(stderr=True, width=170)
MODELS = {"smollm2-135m": SMOLLM2_SHAPED, "llama-3.2-1b": LLAMA_1B_SHAPED}
MODES = {"compute": (False, 0), "stream": (True, 0), "by size": (True, MIN_STREAM_BYTES)}
"""Engines by where their tier copies go: (copy_stream, copy_stream_min_bytes)."""
HITS = {
    "device": "by size",
    "host_compute_stream": "compute",
    "host_copy_stream": "stream",
    "host_by_size": "by size",
}
"""The hit paths, each on its engine (the device hit has no copy to place)."""
PATHS = ("cold", *HITS)


def parse_case(text: str) -> tuple[int, int]:
    cached, _, new = text.partition("+")
    if not new or int(cached) < 16 or int(new) < 1:
        raise argparse.ArgumentTypeError(f"a case is P+N, P >= 16 cached and N >= 1 new: {text!r}")
    return int(cached), int(new)


def _engine(model: CausalLM, length: int, mode: str) -> Engine:
    copy_stream, min_bytes = MODES[mode]
    return bench_engine(
        model,
        None,
        length,
        host_pages=length // 16 + 16,
        copy_stream=copy_stream,
        copy_stream_min_bytes=min_bytes,
    )


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _hit(
    engine: Engine, prefix: list[int], prompt: list[int], tag: str, demote: bool
) -> tuple[float, int, int]:
    """TTFT of `prompt` with `prefix` cached (on the host when `demote`): (seconds, first token,
    cached prompt tokens)."""
    tree = engine.cache.tree
    tree.clear()
    first_token(engine, prefix, f"{tag}-prefix")
    if demote:
        tree.evict(tree.evictable_pages)  # every cached page to the host tier
        engine.runner.copy_pages(engine.cache.take_tier_copies())
    _sync()
    seconds, output = first_token(engine, prompt, tag)
    return seconds, output.token_ids[0], output.cached_prompt_tokens


def transfer_ms(nbytes: int) -> float:
    """One pinned host-to-device copy of `nbytes`, timed with CUDA events (median of 5)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_()
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def measure(
    name: str, config: ModelConfig, cached: int, new: int, repeats: int, device: str = "cuda"
) -> dict:
    """The five paths for one model and case (`device` "cpu": the tests' small run, where both
    tiers are RAM and no transfer is timed)."""
    length = cached + new + 64
    config = replace(config, max_position_embeddings=max(config.max_position_embeddings, length))
    model = tiny_model(config, seed=0).to(device, torch.bfloat16)
    gen = torch.Generator().manual_seed(cached + new)
    prompt = torch.randint(3, config.vocab_size, (cached + new,), generator=gen).tolist()
    prefix = prompt[:cached]
    engines = {mode: _engine(model, len(prompt), mode) for mode in MODES}
    for engine in engines.values():  # compile the kernels for these shapes, every path
        _hit(engine, prefix, prompt, "warmup", demote=True)
        _hit(engine, prefix, prompt, "warmup", demote=False)
        engine.cache.tree.clear()
        first_token(engine, prompt, "warmup-cold")
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    firsts: dict[str, set[int]] = {path: set() for path in PATHS}
    cached_tokens: dict[str, int] = {}
    before = engines["stream"].stats()
    for r in range(repeats):
        engine = engines["by size"]
        engine.cache.tree.clear()
        seconds, output = first_token(engine, prompt, f"cold{r}")
        times["cold"].append(seconds)
        firsts["cold"].add(output.token_ids[0])
        for path, mode in HITS.items():
            demote = path != "device"
            seconds, token, hit = _hit(engines[mode], prefix, prompt, f"{path}{r}", demote)
            times[path].append(seconds)
            firsts[path].add(token)
            cached_tokens[path] = hit
    promoted = engines["stream"].stats().promoted_pages - before.promoted_pages
    nbytes = promoted // repeats * engines["stream"].runner.page_bytes
    ms = {path: 1000 * statistics.median(values) for path, values in times.items()}
    extra = ms["host_compute_stream"] - ms["device"]
    hidden = (ms["host_compute_stream"] - ms["host_copy_stream"]) / extra if extra > 0 else None
    hits = set().union(*(firsts[path] for path in HITS))
    result = {
        "model": name,
        "cached": cached,
        "new": new,
        "repeats": repeats,
        **{f"{path}_ms": value for path, value in ms.items()},
        "promoted_mb": nbytes / 1e6,
        "transfer_ms": transfer_ms(nbytes) if nbytes and device == "cuda" else 0.0,
        "hidden": hidden,
        "cached_tokens": cached_tokens,
        "hits_agree": len(hits) == 1,
        "cold_agrees": firsts["cold"] == hits,
        "first_tokens": {path: sorted(tokens) for path, tokens in firsts.items()},
        "ttft_ms": {path: [1000 * t for t in values] for path, values in times.items()},
    }
    del engines, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def table(rows: list[dict]) -> Table:
    out = Table(title=f"host-tier hits on {torch.cuda.get_device_name()}, bf16 (ms, medians)")
    for column in (
        "model", "cached + new", "cold", "device hit", "host, compute stream",
        "host, copy stream", "host, by size", "MB", "transfer", "hidden", "hits agree",
        "cold agrees",
    ):  # fmt: skip
        out.add_column(column, justify="right")
    for r in rows:
        hidden = "-" if r["hidden"] is None else f"{100 * r['hidden']:.0f} %"
        out.add_row(
            r["model"],
            f"{r['cached']} + {r['new']}",
            *(f"{r[f'{path}_ms']:.1f}" for path in PATHS),
            f"{r['promoted_mb']:.0f}",
            f"{r['transfer_ms']:.2f}",
            hidden,
            "yes" if r["hits_agree"] else "NO",
            "yes" if r["cold_agrees"] else "no",
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", type=parse_case, nargs="+", default=["1024+1", "8192+1", "8192+1024"]
    )
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    cases = [parse_case(c) if isinstance(c, str) else c for c in args.cases]
    if not torch.cuda.is_available():
        console.print("needs a CUDA device: nothing was measured")
        return 2
    rows = []
    for name in args.models:
        for cached, new in cases:
            rows.append(measure(name, MODELS[name], cached, new, args.repeats))
            console.print(f"{name} {cached}+{new}: done")
    console.print(table(rows))
    print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
