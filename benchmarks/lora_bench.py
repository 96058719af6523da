"""What serving LoRA adapters costs: decode and prefill throughput with 0, 1, 4 and 16 distinct
adapters in the batch, next to the base model alone, in the same run.

The model forward goes through `ModelRunner` (paged KV, the step shapes the engine builds):

- decode: `--decode-batch` sequences (16) with `--decode-context` tokens (128) of KV each, one
  token per sequence per step; tokens/s over `--decode-steps` steps;
- prefill: `--prefill-seqs` prompts (4) of `--prefill-len` tokens (256) in one step; tokens/s.

Rows: the base model without LoRA stacks; the base model with stacks loaded but no adapter in
the batch (what serving LoRA costs a base-only step: nothing, by design); then N adapters in the
batch for N in --adapters, each targeting every projection or only q/v (--targets). Sequence i
uses adapter i * N // batch (the engine orders chunks by slot, so each adapter is one segment).
The adapters are random, rank --rank (16), in LoraStacks of max(--adapters) slots.
Each repeat measures every row once, in turn (alternating, so drift in a shared machine's load
hits every row alike); the table shows medians and the ratio to the base model's median.
Issue 17's target: >= 80 % of base throughput with 4 adapters.

Prints a table on stderr and one JSON object on stdout (and --output); --plot FILE draws a bar
chart. Run: `python benchmarks/lora_bench.py [--model smollm2|tiny] [--threads 2]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from rich.console import Console
from rich.table import Table

from cluster.progress import progress_bar
from worker.config import ModelConfig
from worker.loader import load_model
from worker.lora_adapter import TARGET_MODULES, LoraAdapter
from worker.lora_weights import LoraStacks, module_shapes
from worker.model import CausalLM
from worker.model_runner import Chunk, ModelRunner
from worker.tiny_model import TINY_CONFIG, tiny_model

console = Console(stderr=True)
TARGET_RATIO = 0.80
"""Issue 17: throughput with 4 adapters in the batch >= this fraction of the base model's."""
TARGETS = {"all": TARGET_MODULES, "qv": ("q_proj", "v_proj")}
PAGE_SIZE = 16


@dataclass(frozen=True)
class Timing:
    tokens: int
    wall_s: float
    cpu_s: float
    """CPU seconds of the whole process (every thread): what the step cost, however long it
    waited for a core on a shared machine."""

    def per_second(self, clock: str) -> float:
        return self.tokens / (self.wall_s if clock == "wall" else self.cpu_s)


@dataclass(frozen=True)
class Case:
    label: str
    adapters: int
    """Distinct adapters in the batch; 0: the base model."""
    targets: str | None
    """A key of TARGETS; None: no stacks at all."""


def random_adapter(
    config: ModelConfig, seed: int, rank: int, modules: tuple[str, ...]
) -> LoraAdapter:
    """An adapter of seeded random factors (their values do not matter to the timing)."""
    generator = torch.Generator().manual_seed(seed)
    name = f"random-{seed}"
    shapes = module_shapes(config)
    weights = {}
    for layer in range(config.num_layers):
        for module in modules:
            fan_in, fan_out = shapes[module]
            a = torch.randn((rank, fan_in), generator=generator) / fan_in**0.5
            b = torch.randn((fan_out, rank), generator=generator) / rank**0.5
            weights[(layer, module)] = (a, b)
    return LoraAdapter(name, f"random:{name}", rank, 2.0 * rank, 2.0, f"{seed:016x}", weights)


def build_stacks(model: CausalLM, slots: int, rank: int, modules: tuple[str, ...]) -> LoraStacks:
    weight = model.model.embed_tokens.weight
    stacks = LoraStacks(model.config, slots, rank, weight.device, model.dtype)
    for slot in range(slots):
        stacks.load(slot, random_adapter(model.config, slot, rank, modules))
    return stacks


def slots_of(batch: int, adapters: int) -> list[int]:
    """Each sequence's slot: contiguous groups, one per adapter; -1 throughout for none."""
    return [i * adapters // batch if adapters else -1 for i in range(batch)]


class Workload:
    """The decode and prefill steps of one case, over one runner's pages."""

    def __init__(
        self,
        runner: ModelRunner,
        args: argparse.Namespace,
        slots_decode: list[int],
        slots_prefill: list[int],
    ) -> None:
        self.runner, self.args = runner, args
        vocab = runner.model.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        per_seq = -(-(max(args.decode_context + 1, args.prefill_len)) // PAGE_SIZE)
        rows = [
            list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))
            for i in range(max(args.decode_batch, args.prefill_seqs))
        ]
        context = args.decode_context
        self.prompts = [
            torch.randint(0, vocab, (context,), generator=generator).tolist()
            for _ in range(args.decode_batch)
        ]
        self.decode_chunks = [
            Chunk([p[-1]], context, rows[i], True, slot)
            for i, (p, slot) in enumerate(zip(self.prompts, slots_decode, strict=True))
        ]
        self.context_chunks = [
            Chunk(p, 0, rows[i], False, slot)
            for i, (p, slot) in enumerate(zip(self.prompts, slots_decode, strict=True))
        ]
        self.prefill_chunks = [
            Chunk(
                torch.randint(0, vocab, (args.prefill_len,), generator=generator).tolist(),
                0,
                rows[i],
                True,
                slot,
            )
            for i, slot in enumerate(slots_prefill)
        ]

    def decode(self) -> Timing:
        """`decode_steps` decode steps (each at the same position: a real step's shapes, with
        the context's KV written once beforehand)."""
        return self._timed([self.decode_chunks] * self.args.decode_steps)

    def prefill(self) -> Timing:
        return self._timed([self.prefill_chunks])

    def _timed(self, steps: list[list[Chunk]]) -> Timing:
        wall, cpu = time.perf_counter(), time.process_time()
        for chunks in steps:
            self.runner.run(chunks)
        if self.runner.device.type == "cuda":  # the launches return before the work is done
            torch.cuda.synchronize(self.runner.device)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return Timing(sum(len(c.token_ids) for chunks in steps for c in chunks), wall, cpu)

    def warm(self) -> None:
        self.runner.run(self.context_chunks)
        self.decode()


def pages_needed(args: argparse.Namespace) -> int:
    per_seq = -(-(max(args.decode_context + 1, args.prefill_len)) // PAGE_SIZE)
    return 1 + per_seq * max(args.decode_batch, args.prefill_seqs)


def cases(args: argparse.Namespace) -> list[Case]:
    rows = [Case("base, no stacks", 0, None), Case("base, stacks loaded", 0, args.targets[0])]
    for targets in args.targets:
        rows += [
            Case(f"{n} adapter{'s' if n > 1 else ''}, {targets}", n, targets)
            for n in args.adapters
            if n > 0
        ]
    return rows


def bench(model: CausalLM, args: argparse.Namespace) -> dict:
    slots = max(args.adapters)
    stacks = {t: build_stacks(model, slots, args.rank, TARGETS[t]) for t in args.targets}
    runner_pages = pages_needed(args)
    workloads: dict[Case, Workload] = {}
    runners: dict[str | None, ModelRunner] = {}
    for case in cases(args):
        if case.targets not in runners:
            lora = stacks[case.targets] if case.targets else None
            runners[case.targets] = ModelRunner(model, runner_pages, PAGE_SIZE, lora=lora)
        runner = runners[case.targets]
        workloads[case] = Workload(
            runner,
            args,
            slots_of(args.decode_batch, case.adapters),
            slots_of(args.prefill_seqs, case.adapters),
        )
    measured: dict[Case, dict[str, list[Timing]]] = {
        c: {"decode": [], "prefill": []} for c in workloads
    }
    phases: list[tuple[str, Callable[[Workload], Timing]]] = [
        ("decode", Workload.decode),
        ("prefill", Workload.prefill),
    ]
    with progress_bar(console=console, transient=True) as progress:
        task = progress.add_task("warm-up", total=len(workloads) * (1 + 2 * args.repeats))
        for workload in workloads.values():
            workload.warm()
            progress.advance(task)
        for r in range(args.repeats):
            for phase, measure in phases:
                for case, workload in workloads.items():
                    progress.update(
                        task, description=f"repeat {r + 1}/{args.repeats}: {phase}, {case.label}"
                    )
                    if phase == "decode":
                        workload.runner.run(workload.context_chunks)  # this case's KV, untimed
                    measured[case][phase].append(measure(workload))
                    progress.advance(task)
    base = next(iter(workloads))
    rows = []
    for case, values in measured.items():
        row: dict = {"case": case.label, "adapters": case.adapters, "targets": case.targets}
        for phase, timings in values.items():
            base_median = statistics.median(t.per_second(args.clock) for t in measured[base][phase])
            median = statistics.median(t.per_second(args.clock) for t in timings)
            row[f"{phase}_tokens_per_s"] = median
            row[f"{phase}_ratio"] = median / base_median
            row[f"{phase}_samples"] = [
                {"tokens": t.tokens, "wall_s": t.wall_s, "cpu_s": t.cpu_s} for t in timings
            ]
        rows.append(row)
    return {
        "stacks_mb": {t: s.nbytes / 1e6 for t, s in stacks.items()},
        "rows": rows,
        "within_target": all(
            min(row["decode_ratio"], row["prefill_ratio"]) >= TARGET_RATIO
            for row in rows
            if row["adapters"] == 4
        ),
    }


def table(result: dict) -> Table:
    verdict = "met" if result["within_target"] else "NOT met"
    r = result
    title = (
        f"LoRA throughput: {r['model']}, rank {r['rank']}, decode {r['decode_batch']} x 1 "
        f"(context {r['decode_context']}), prefill {r['prefill_seqs']} x {r['prefill_len']}, "
        f"{r['threads']} threads, tokens per {r['clock']} second, median of {r['repeats']} "
        f"(target >= {TARGET_RATIO:.0%} "
        f"of base at 4 adapters: {verdict})"
    )
    out = Table(title=title)
    for column in ("case", "decode tok/s", "of base", "prefill tok/s", "of base"):
        out.add_column(column, justify="left" if column == "case" else "right")
    for row in result["rows"]:
        out.add_row(
            row["case"],
            f"{row['decode_tokens_per_s']:.1f}",
            f"{row['decode_ratio']:.1%}",
            f"{row['prefill_tokens_per_s']:.1f}",
            f"{row['prefill_ratio']:.1%}",
        )
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [row["case"] for row in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for axis, phase in zip(axes, ("decode", "prefill"), strict=True):
        axis.barh(labels, [row[f"{phase}_ratio"] for row in rows], color="tab:blue")
        axis.axvline(
            TARGET_RATIO, color="tab:red", linestyle="--", label=f"target {TARGET_RATIO:.0%}"
        )
        axis.set_title(f"{phase} throughput, fraction of base")
        axis.set_xlim(0, 1.1)
        axis.invert_yaxis()
        axis.legend(loc="lower right")
    fig.suptitle(
        f"LoRA on {result['model']}, rank {result['rank']}, {result['threads']} CPU threads"
    )
    fig.tight_layout()
    fig.savefig(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--targets", nargs="+", choices=list(TARGETS), default=["all", "qv"])
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--decode-context", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--prefill-seqs", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="tokens per wall second, or per CPU second of the process (steadier on a shared "
        "machine: it counts the work, not the waiting)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="write a bar chart (PNG) here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = (
        load_model("default").model if args.model == "smollm2" else tiny_model(TINY_CONFIG, seed=0)
    )
    result = {
        "model": args.model,
        "rank": args.rank,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "repeats": args.repeats,
        "decode_batch": args.decode_batch,
        "decode_context": args.decode_context,
        "prefill_seqs": args.prefill_seqs,
        "prefill_len": args.prefill_len,
        "target_ratio": TARGET_RATIO,
        **bench(model, args),
    }
    console.print(table(result))
    print(json.dumps(result))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2))
    if args.plot is not None:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
