"""Old against new for the decode step's fusions, alternated in one process: q/k/v and gate/up as
one matrix each (worker/fused_projections.py, and q and k rotated as one tensor), and what every
layer of a step shares computed once a step (kernels/torch_sdpa.py's `_STEP_MEMO`), each on and
off, then both with the layers run as worker/decode_layers.py's flat loop ("flat"; the others
go through the modules), for one request decoding greedily.

Each round runs every variant for --steps steps (after 3 warm-up steps) in turn; a variant's
figure is the median over rounds of its per-round median step time. Every variant computes the
same bits (tests/worker/test_fused_projections.py, tests/kernels/test_torch_sdpa.py,
tests/worker/test_decode_layers.py), so only
time is compared. Prints a table on stderr and one JSON object on stdout.
Run: `python benchmarks/decode_ab.py [--weights int4] [--context 64 1024] [--threads 2]`
(`--model tiny`: the seeded tiny model, for a quick check).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.decode_profile import decoding_engine
from benchmarks.weights_axis import load_for_bench
from kernels import torch_sdpa
from worker.model import CausalLM

console = Console(stderr=True)
VARIANTS = ("neither", "fused", "memo", "both", "flat")


class _NoMemo:
    """A `_StepMemo` that always recomputes: every layer derives its own, as before."""

    def lookup(self, tensors: tuple[Any, ...], extra: tuple[int, ...], compute: Any) -> Any:
        del tensors, extra
        return compute()


def set_variant(model: CausalLM, fused: list[tuple[Any, Any]], variant: str) -> None:
    on = variant in ("fused", "both", "flat")
    for layer, (qkv, gate_up) in zip(model.model.layers, fused, strict=True):
        layer.self_attn.qkv_proj = qkv if on else None
        layer.mlp.gate_up_proj = gate_up if on else None
    model.forget_decode_layers()  # the loop reads the modules just set
    model.flat_decode = variant == "flat"
    memo = variant in ("memo", "both", "flat")
    torch_sdpa._STEP_MEMO = MEMO if memo else _NoMemo()  # type: ignore[assignment]


MEMO = torch_sdpa._STEP_MEMO


def measure(model: CausalLM, context: int, steps: int, rounds: int) -> dict[str, float]:
    fused = [(layer.self_attn.qkv_proj, layer.mlp.gate_up_proj) for layer in model.model.layers]
    if any(qkv is None for qkv, _ in fused):
        raise SystemExit("the model has no fused projections (float32 keeps nn.Linear)")
    _, step = decoding_engine(model, context, (steps + 3) * len(VARIANTS) * rounds)
    medians: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for _ in range(rounds):
            for variant in VARIANTS:
                set_variant(model, fused, variant)
                for _ in range(3):
                    step()
                times = []
                for _ in range(steps):
                    began = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - began)
                medians[variant].append(1000 * statistics.median(times))
    finally:
        set_variant(model, fused, "flat")
    return {v: statistics.median(m) for v, m in medians.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--weights", default="int4", help="bf16 | int8 | int4")
    parser.add_argument("--context", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_for_bench(args.model, args.weights)
    results = {c: measure(model, c, args.steps, args.rounds) for c in args.context}
    table = Table(title=f"{args.model} {args.weights} decode step (ms), {args.threads} threads")
    table.add_column("context", justify="right")
    for variant in VARIANTS:
        table.add_column(variant, justify="right")
    table.add_column("both / neither", justify="right")
    table.add_column("flat / both", justify="right")
    for context, row in results.items():
        ratios = (row["both"] / row["neither"], row["flat"] / row["both"])
        table.add_row(
            str(context), *(f"{x:.1f}" for x in row.values()), *(f"{r:.2f}" for r in ratios)
        )
    console.print(table)
    summary = {"model": args.model, "weights": args.weights, "threads": args.threads}
    print(json.dumps({**summary, "step_ms": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
