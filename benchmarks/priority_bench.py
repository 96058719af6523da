"""What the priority scheduling policy buys: interactive requests' TTFT on a worker kept busy by
batch work, under `fcfs` and under `priority` (engine.scheduling_policy), and what it costs the
batch work.

One in-process engine per run (the worker's engine, on its own thread, real model). Batch
requests are closed-loop: `--batch` of them are always in flight (more than `max_running`, so a
queue always waits), each a long prompt and a long answer, priority 1. Interactive requests
arrive open-loop, a Poisson stream at `--rate` a second, each a short prompt and answer,
priority 0. Under `fcfs` every request has priority 0 and the interactive ones queue behind the
batch ones; under `priority` they are admitted first, preempting a batch sample for its running
slot or pages. Prompts are random token ids (no two share a prefix), the same sequence in every
run; runs alternate policy (`--rounds` pairs, which goes first alternating), so both see the
same machine.

Reported per policy (median over rounds): interactive TTFT p50 / p90 / p99 and end-to-end p50,
batch tokens a second (the batch work's throughput while interactive traffic ran), all tokens a
second (batch and interactive: what preempting costs the engine), and the preemptions per
interactive request. One JSON line per run, then a table; `--plot` draws the
interactive TTFT distributions.

Run: `python benchmarks/priority_bench.py [--interactive 60] [--rounds 2] [--model tiny|default]`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
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

console = Console(stderr=True)
POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class Shape:
    batch_prompt: int = 384
    batch_tokens: int = 96
    interactive_prompt: int = 48
    interactive_tokens: int = 16


@dataclass
class Run:
    """One policy's run: per interactive request its submit, first-token and end times."""

    policy: str
    submitted: dict[str, float] = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)
    ended: dict[str, float] = field(default_factory=dict)
    batch_tokens: int = 0
    interactive_tokens: int = 0
    batch_started: float = 0.0
    batch_window: float = 0.0
    preemptions: int = 0

    def report(self) -> dict[str, float | str | None]:
        ttft = percentiles(self.first[r] - self.submitted[r] for r in self.submitted)
        latency = percentiles(self.ended[r] - self.submitted[r] for r in self.submitted)
        return {
            "policy": self.policy,
            "interactive": len(self.submitted),
            "ttft_p50_ms": ttft["p50"],
            "ttft_p90_ms": ttft["p90"],
            "ttft_p99_ms": ttft["p99"],
            "latency_p50_ms": latency["p50"],
            "batch_tokens_per_s": self.batch_tokens / self.batch_window,
            "all_tokens_per_s": (self.batch_tokens + self.interactive_tokens) / self.batch_window,
            "preemptions_per_interactive": self.preemptions / max(1, len(ttft)),
        }


class PolicyRun:
    """One run: an engine under `policy`, its batch load kept topped up, the interactive
    arrivals timed."""

    def __init__(self, loaded: LoadedModel, policy: str, args: argparse.Namespace) -> None:
        config = EngineConfig(
            num_pages=args.pages,
            page_size=16,
            max_running=args.max_running,
            token_budget=256,
            max_prefill_chunk=256,
            max_model_len=1024,
            max_waiting=4096,
            scheduling_policy=policy,
            model_revision=loaded.revision,
        )
        self.engine = Engine(loaded.model, loaded.tokenizer, config)
        self.vocab = loaded.model.config.vocab_size
        self.args, self.shape, self.run = args, Shape(), Run(policy)
        self.lock, self.done = threading.Lock(), threading.Event()
        self.batch_free = threading.Semaphore(args.batch)
        self.batch_ids = 0
        self.high, self.low = (0, 1) if policy == "priority" else (0, 0)

    def request(self, request_id: str, prompt: int, tokens: int, priority: int) -> GenerateRequest:
        """The same ids for the same request id in every run (no two requests share a prefix)."""
        rng = random.Random(f"{self.args.seed}:{request_id}")
        ids = tuple(rng.randrange(3, self.vocab) for _ in range(prompt))
        sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        return GenerateRequest(request_id, ids, sampling=sampling, priority=priority)

    def on_batch(self, output: RequestOutput) -> None:
        with self.lock:
            if not self.done.is_set():
                self.run.batch_tokens += len(output.token_ids)
        if output.finished:
            self.batch_free.release()

    def on_interactive(self, output: RequestOutput, advance: Callable[[], None]) -> None:
        now = time.perf_counter()
        with self.lock:
            self.run.interactive_tokens += len(output.token_ids)
            if output.token_ids:
                self.run.first.setdefault(output.request_id, now)
            if output.finished:
                self.run.ended[output.request_id] = now
                advance()
                if len(self.run.ended) == self.args.interactive:
                    self.done.set()

    def top_up(self, until: float) -> None:
        """Keep `--batch` batch requests in flight until `until` (perf_counter seconds)."""
        shape = self.shape
        while (left := until - time.perf_counter()) > 0 or self.batch_ids < self.args.batch:
            if self.batch_free.acquire(timeout=max(0.0, min(0.005, left))):
                request_id = f"b{self.batch_ids}"
                batch = self.request(request_id, shape.batch_prompt, shape.batch_tokens, self.low)
                self.engine.submit(batch, self.on_batch)
                self.batch_ids += 1

    def __call__(self, progress: Progress) -> Run:
        args, run, shape = self.args, self.run, self.shape
        task = progress.add_task(f"{run.policy}: interactive requests", total=args.interactive)
        arrivals = random.Random(args.seed)  # the same arrival times in every run
        self.engine.start()
        try:
            self.top_up(time.perf_counter() + args.warmup)  # a queue waits before the first
            with self.lock:
                run.batch_started, run.batch_tokens = time.perf_counter(), 0
            next_at = run.batch_started
            for i in range(args.interactive):
                next_at += arrivals.expovariate(args.rate)
                self.top_up(next_at)
                asked = self.request(
                    f"i{i}", shape.interactive_prompt, shape.interactive_tokens, self.high
                )
                with self.lock:
                    run.submitted[asked.request_id] = time.perf_counter()
                self.engine.submit(
                    asked, lambda o: self.on_interactive(o, lambda: progress.advance(task))
                )
            if not self.done.wait(timeout=args.timeout):
                raise RuntimeError(f"{run.policy}: unfinished after {args.timeout} s")
            run.batch_window = time.perf_counter() - run.batch_started
            run.preemptions = self.engine.stats().preemptions
        finally:
            self.engine.stop()
        progress.remove_task(task)
        return run


def table(reports: list[dict[str, float | str | None]], rounds: int) -> Table:
    out = Table(title=f"interactive TTFT under batch load (median of {rounds} rounds)")
    columns = [
        ("ttft_p50_ms", "TTFT p50 ms"),
        ("ttft_p90_ms", "TTFT p90 ms"),
        ("ttft_p99_ms", "TTFT p99 ms"),
        ("latency_p50_ms", "latency p50 ms"),
        ("batch_tokens_per_s", "batch tok/s"),
        ("all_tokens_per_s", "all tok/s"),
        ("preemptions_per_interactive", "preemptions / interactive"),
    ]
    out.add_column("policy")
    for _, title in columns:
        out.add_column(title, justify="right")
    for policy in POLICIES:
        mine = [r for r in reports if r["policy"] == policy]
        cells = []
        for key, _ in columns:
            values = [float(r[key] or 0.0) for r in mine]  # every run has its requests
            low, mid, high = min(values), statistics.median(values), max(values)
            cells.append(f"{mid:,.1f} ({low:,.1f}-{high:,.1f})" if rounds > 1 else f"{mid:,.1f}")
        out.add_row(policy, *cells)
    return out


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for policy in POLICIES:
        ttft = sorted(
            1000 * (r.first[k] - r.submitted[k])
            for r in runs
            if r.policy == policy
            for k in r.submitted
        )
        axes.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=policy)
    axes.set_xscale("log")
    axes.set_xlabel("interactive TTFT (ms, log)")
    axes.set_ylabel("fraction of requests")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny', 'default' (SmolLM2) or a path")
    parser.add_argument("--interactive", type=int, default=60, help="interactive requests a run")
    parser.add_argument("--rate", type=float, default=4.0, help="interactive arrivals a second")
    parser.add_argument("--batch", type=int, default=16, help="batch requests always in flight")
    parser.add_argument("--max-running", type=int, default=8)
    parser.add_argument("--pages", type=int, default=512, help="KV pool pages of 16")
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs, alternating")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of batch load first")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=None, help="a PNG of the TTFT CDFs")
    args = parser.parse_args()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as in the worker actor
    source = model_source(args.model)
    loaded = load_model(source)
    runs, reports = [], []
    with Progress(console=console, transient=True) as progress:
        for round_ in range(args.rounds):
            order = POLICIES if round_ % 2 == 0 else POLICIES[::-1]
            for policy in order:
                run = PolicyRun(loaded, policy, args)(progress)
                runs.append(run)
                reports.append(run.report() | {"round": round_, "model": args.model})
                print(json.dumps(reports[-1]), flush=True)
    console.print(table(reports, args.rounds))
    if args.plot is not None:
        plot(runs, args.plot)
        console.print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
