"""What n-gram speculative decoding buys (engine.num_speculative_tokens): decoding speed with
drafts of up to k tokens against none, on chats that copy their prompt and chats that do not;
with `--predict`, also what a predicted output (OpenAI's `prediction`, drafts of up to
engine.num_prediction_tokens) buys with each k, where the client has one to give.

One in-process engine per run (the worker's engine, on its own thread, real model), greedy
chats through the model's chat template, `--concurrency` requests in flight (closed loop) until
`--requests` have finished. Workloads:

- `edit`: rewrite a given function with one name changed (the answer copies most of the prompt);
- `repeat`: repeat a given paragraph;
- `stale`: the same, the client's prediction an older version of the paragraph (a word put in
  its middle and another left out after it: the answer leaves the prediction twice);
- `free`: an open question (little to copy: what drafts cost when they miss).

The predictions are what the client of each would send: the function as it stands, fenced as
the answer is asked to be (`edit`), the paragraph (`repeat`), its older version (`stale`);
`free` has none, and is run without.

Runs alternate k within each round (`--rounds`, which k goes first rotating), so every k sees
the same machine. Reported per (workload, k), median and min-max over rounds: output tokens a
second over the run, time per output token (TPOT: a request's decoding time over its tokens
after the first, median over requests), TTFT p50, the draft tokens kept of those verified, and
whether every answer equals the k=0 run's (greedy: it must); with a prediction, the usage's
accepted and rejected prediction tokens too. One JSON line per run, then a table; `--plot`
draws tokens a second per workload.

Run: `python benchmarks/speculative_bench.py [--model default|tiny|PATH] [--k 0 4] [--predict]
[--rounds 2]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from benchmarks.model_source import model_source
from cluster.loadtest.metrics import percentiles
from worker.actor import SWITCH_INTERVAL_S
from worker.engine import Engine, EngineConfig
from worker.loader import LoadedModel, load_model
from worker.request import GenerateRequest, RequestOutput
from worker.sampling_params import SamplingParams

console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)

FUNCTION = '''def merge_intervals(intervals):
    """Merge overlapping intervals given as (start, end) pairs."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]
'''
PARAGRAPHS = (
    "The lighthouse stood at the edge of the cliff, its white tower striped with red, and every "
    "night its lamp turned slowly over the dark water so that the fishing boats could find "
    "their way home through the rocks.",
    "A radix tree stores strings by their shared prefixes: each edge holds a run of characters, "
    "and a lookup walks from the root, matching one edge after another until the key ends or "
    "no edge matches.",
    "On Monday the market opens at seven; the bakers arrive first, then the fruit sellers, and "
    "by nine the square is so full of voices that you can hardly hear the church bell ring.",
)
QUESTIONS = (
    "Write a short poem about the sea.",
    "What are three good habits for learning a new language?",
    "Describe a busy city street in the morning.",
)


def workload(name: str, i: int) -> tuple[dict[str, str], ...]:
    """The chat of request `i` of a workload (they cycle through a few variants)."""
    if name == "edit":
        old, new = [("intervals", "spans"), ("merged", "result"), ("ordered", "by_start")][i % 3]
        text = (
            f"Rewrite this Python function, renaming `{old}` to `{new}` everywhere. "
            f"Reply with the code only.\n\n```python\n{FUNCTION}```"
        )
    elif name in ("repeat", "stale"):
        text = f"Repeat the following paragraph exactly.\n\n{PARAGRAPHS[i % len(PARAGRAPHS)]}"
    elif name == "free":
        text = QUESTIONS[i % len(QUESTIONS)]
    else:
        raise ValueError(f"unknown workload {name!r}: edit, repeat, stale or free")
    return ({"role": "user", "content": text},)


def prediction(name: str, i: int) -> str:
    """What the client of request `i` of a workload predicts the answer is ("": nothing)."""
    if name == "edit":
        return f"```python\n{FUNCTION}```"
    if name == "repeat":
        return PARAGRAPHS[i % len(PARAGRAPHS)]
    if name == "stale":
        words = PARAGRAPHS[i % len(PARAGRAPHS)].split(" ")
        middle = len(words) // 2
        kept = [*words[:middle], "quite", *words[middle : middle + 4], *words[middle + 5 :]]
        return " ".join(kept)
    return ""


WORKLOADS = ("edit", "repeat", "stale", "free")


@dataclass
class Run:
    workload: str
    k: int
    predicted: bool = False
    """Whether the requests carried the workload's prediction."""
    submitted: dict[str, float] = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)
    ended: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    """The usage's, summed over the requests."""
    wall: float = 0.0

    @property
    def setup(self) -> str:
        return f"{self.k} + prediction" if self.predicted else str(self.k)

    def report(self) -> dict[str, float | str | int | None]:
        decoding = [
            (self.ended[r] - self.first[r]) / (len(self.tokens[r]) - 1)
            for r in self.ended
            if len(self.tokens[r]) > 1
        ]
        output = sum(len(t) for t in self.tokens.values())
        ttft = percentiles(self.first[r] - self.submitted[r] for r in self.first)
        return {
            "workload": self.workload,
            "k": self.k,
            "prediction": self.predicted,
            "requests": len(self.ended),
            "output_tokens": output,
            "tokens_per_s": output / self.wall if self.wall else None,
            "tpot_ms": 1000 * statistics.median(decoding) if decoding else None,
            "ttft_p50_ms": ttft["p50"],  # percentiles gives milliseconds
            "draft_tokens": self.draft_tokens,
            "accepted_draft_tokens": self.accepted_draft_tokens,
            "acceptance": self.accepted_draft_tokens / self.draft_tokens
            if self.draft_tokens
            else None,
            "accepted_prediction_tokens": self.accepted_prediction_tokens,
            "rejected_prediction_tokens": self.rejected_prediction_tokens,
        }


class SpeculationRun:
    """One run: `--requests` chats of one workload, `--concurrency` in flight, n-gram drafts of
    up to `k` tokens (0: none), each chat with its prediction when `predicted`."""

    def __init__(
        self,
        loaded: LoadedModel,
        name: str,
        k: int,
        args: argparse.Namespace,
        predicted: bool = False,
    ) -> None:
        config = EngineConfig(
            num_pages=args.pages,
            page_size=16,
            max_running=max(args.concurrency, 1),
            max_model_len=2048,
            num_speculative_tokens=k,
            num_prediction_tokens=args.prediction_tokens,
            model_revision=loaded.revision,
        )
        self.engine = Engine(loaded.model, loaded.tokenizer, config)
        self.args, self.run = args, Run(name, k, predicted)
        self.lock, self.done = threading.Lock(), threading.Event()
        self.slots = threading.Semaphore(args.concurrency)

    def on_output(self, output: RequestOutput, advance: object) -> None:
        now = time.perf_counter()
        run = self.run
        with self.lock:
            if output.token_ids:
                run.first.setdefault(output.request_id, now)
                run.tokens.setdefault(output.request_id, []).extend(output.token_ids)
            run.accepted_prediction_tokens += output.accepted_prediction_tokens
            run.rejected_prediction_tokens += output.rejected_prediction_tokens
            if output.finished:
                if output.error:
                    console.print(f"{output.request_id}: {output.error}")
                run.ended[output.request_id] = now
                run.tokens.setdefault(output.request_id, [])
                self.slots.release()
                advance()  # type: ignore[operator]
                if len(run.ended) == self.args.requests:
                    self.done.set()

    def sampling(self, i: int) -> SamplingParams:
        """Request `i`'s: greedy, with its workload's prediction in a predicted run."""
        run = self.run
        return SamplingParams(
            max_tokens=self.args.max_tokens,
            temperature=0.0,
            prediction=prediction(run.workload, i) if run.predicted else "",
        )

    def __call__(self, progress: Progress) -> Run:
        args, run = self.args, self.run
        task = progress.add_task(f"{run.workload}, k={run.setup}", total=args.requests)
        self.engine.start()
        began = time.perf_counter()
        try:
            for i in range(args.requests):
                self.slots.acquire()
                request = GenerateRequest(
                    f"{run.workload}-{i}",
                    messages=workload(run.workload, i),
                    sampling=self.sampling(i),
                )
                with self.lock:
                    run.submitted[request.request_id] = time.perf_counter()
                self.engine.submit(
                    request, lambda o: self.on_output(o, lambda: progress.advance(task))
                )
            if not self.done.wait(timeout=args.timeout):
                raise RuntimeError(
                    f"{run.workload}, k={run.setup}: unfinished after {args.timeout} s"
                )
            run.wall = time.perf_counter() - began
            stats = self.engine.stats()
            run.draft_tokens, run.accepted_draft_tokens = (
                stats.draft_tokens,
                stats.accepted_draft_tokens,
            )
        finally:
            self.engine.stop()
        progress.remove_task(task)
        return run


def same_answers(runs: list[Run]) -> list[bool | None]:
    """For each run, whether its answers equal those of its workload's first k=0 run (None:
    there is none)."""
    plain: dict[str, dict[str, list[int]]] = {}
    for run in runs:
        if run.k == 0 and not run.predicted:
            plain.setdefault(run.workload, run.tokens)
    return [run.tokens == plain[run.workload] if run.workload in plain else None for run in runs]


def table(reports: list[dict[str, float | str | int | None]], rounds: int) -> Table:
    out = Table(title=f"n-gram drafts and predicted outputs (median of {rounds} rounds, min-max)")
    columns = [
        ("tokens_per_s", "output tok/s"),
        ("tpot_ms", "TPOT ms"),
        ("ttft_p50_ms", "TTFT p50 ms"),
        ("acceptance", "drafts kept"),
    ]
    out.add_column("workload")
    out.add_column("k", justify="right")
    for _, title in columns:
        out.add_column(title, justify="right")
    out.add_column("prediction tokens accepted / rejected", justify="right")
    out.add_column("same answers as k=0")
    for name, k, predicted in sorted({_key(r) for r in reports}, key=_order):
        mine = [r for r in reports if _key(r) == (name, k, predicted)]
        cells = []
        for key, _ in columns:
            values = [float(v) for r in mine if (v := r[key]) is not None]
            if not values:
                cells.append("-")
                continue
            low, mid, high = min(values), statistics.median(values), max(values)
            digits = 2 if key == "acceptance" else 1
            cells.append(
                f"{mid:,.{digits}f} ({low:,.{digits}f}-{high:,.{digits}f})"
                if rounds > 1
                else f"{mid:,.{digits}f}"
            )
        same = {r.get("same_as_k0") for r in mine}
        usage = "-"
        if predicted:
            accepted = statistics.median(int(r["accepted_prediction_tokens"] or 0) for r in mine)
            rejected = statistics.median(int(r["rejected_prediction_tokens"] or 0) for r in mine)
            usage = f"{accepted:,.0f} / {rejected:,.0f}"
        out.add_row(
            name,
            f"{k} + prediction" if predicted else str(k),
            *cells,
            usage,
            "yes" if same == {True} else "no" if False in same else "-",
        )
    return out


def _key(report: dict[str, float | str | int | None]) -> tuple[str, int, bool]:
    return (str(report["workload"]), int(report["k"] or 0), bool(report.get("prediction")))


def _order(key: tuple[str, int, bool]) -> tuple[int, bool, int]:
    name, k, predicted = key
    return (WORKLOADS.index(name) if name in WORKLOADS else len(WORKLOADS), predicted, k)


def plot(reports: list[dict[str, float | str | int | None]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in WORKLOADS if any(r["workload"] == n for r in reports)]
    setups = sorted({_key(r)[1:] for r in reports}, key=lambda s: (s[1], s[0]))
    figure, axes = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(setups)
    for j, (k, predicted) in enumerate(setups):
        heights = [
            statistics.median(
                [float(r["tokens_per_s"] or 0.0) for r in reports if _key(r) == (n, k, predicted)]
                or [0.0]  # a workload without a prediction has no predicted runs
            )
            for n in names
        ]
        label = f"k={k}" + (" + prediction" if predicted else "")
        axes.bar([i + j * width for i in range(len(names))], heights, width, label=label)
    axes.set_xticks([i + width * (len(setups) - 1) / 2 for i in range(len(names))], names)
    axes.set_ylabel("output tokens a second")
    axes.legend()
    axes.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2), 'tiny' or a path")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--k", nargs="+", type=int, default=[0, 4], help="draft lengths (0: off)")
    parser.add_argument(
        "--predict", action="store_true", help="also run each k with the chats' predictions"
    )
    parser.add_argument(
        "--prediction-tokens", type=int, default=16, help="engine.num_prediction_tokens"
    )
    parser.add_argument("--requests", type=int, default=6, help="chats a run")
    parser.add_argument("--concurrency", type=int, default=1, help="chats in flight")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--pages", type=int, default=1024, help="KV pool pages of 16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--plot", type=Path, default=None, help="a PNG of tokens a second")
    args = parser.parse_args()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as in the worker actor
    source = model_source(args.model)
    loaded = load_model(source)
    runs, reports = [], []
    with Progress(console=console, transient=True) as progress:
        for round_ in range(args.rounds):
            for name in args.workloads:
                setups = [(k, False) for k in args.k]
                if args.predict and prediction(name, 0):
                    setups += [(k, True) for k in args.k]
                shift = round_ % len(setups)
                for k, predicted in setups[shift:] + setups[:shift]:
                    run = SpeculationRun(loaded, name, k, args, predicted)(progress)
                    runs.append(run)
                    reports.append(run.report() | {"round": round_, "model": args.model})
    for report, same in zip(reports, same_answers(runs), strict=True):
        report["same_as_k0"] = same
        print(json.dumps(report), flush=True)
    console.print(table(reports, args.rounds))
    if args.plot is not None:
        plot(reports, args.plot)
        console.print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
