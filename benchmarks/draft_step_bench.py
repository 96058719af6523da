"""What verifying a draft costs a decode step (speculative decoding, docs/worker.md).

Engine steps of a SmolLM2-shaped model with seeded random weights (as gpu_decode_bench.py: the
timings do not depend on the values) in which every decoding sample verifies k draft tokens
with its next one, against plain decode steps (k = 0). The drafts come from an oracle in place
of the n-gram lookup, so that both ends of the range are measured whatever the model says:

- `kept`: the continuation the same request decodes greedily without drafts. Each draft token
  is drawn again, so a step yields k + 1 tokens a sample;
- `rejected`: that continuation with every id shifted by one. The first draft token is never
  drawn, so a step yields 1 token a sample and its k rows were computed for nothing.

With t0 the decode step and tk the drafted one, drafts pay when a step keeps more than
tk / t0 - 1 of its draft tokens on average: the break-even that a workload's acceptance
(`speculative_bench.py`, the real model) is set against. A near-tie drawn differently by the
verify rows than by decoding ends a sample's kept drafts; the tokens a step column shows it.
Prints a table on stderr and one JSON object on stdout.
Run: `python benchmarks/draft_step_bench.py [--k 4 8] [--batches 1 16 64]`; `--device cpu` runs
the tiny model on the CPU (no timing worth reading: what the tests run). Exits 2 with a message
when CUDA is asked for and missing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.gpu_decode_bench import CONTEXT, SMOLLM2_SHAPED, decode_config
from worker.config import ModelConfig
from worker.engine import Engine
from worker.model import CausalLM
from worker.request import GenerateRequest, RequestOutput
from worker.sampling_params import SamplingParams
from worker.speculation import NgramIndex
from worker.tiny_model import TINY_CONFIG, tiny_model
from worker.weight_formats import apply_weight_format

console = Console(stderr=True, width=150)
WARMUP = 5
MODES = ("kept", "rejected")


@dataclass
class Setup:
    device: str
    config: ModelConfig
    steps: int
    longest: int
    """The most tokens a request may need: every step of the longest draft kept."""


@dataclass
class Oracle:
    """Draft tokens read off each prompt's greedy continuation (shifted by one id to be
    rejected), in place of `NgramIndex.propose` for the engine's lifetime."""

    continuations: dict[tuple[int, ...], list[int]]
    shift: int
    vocab: int

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        done = len(tokens) - CONTEXT
        ahead = self.continuations[tuple(tokens[:CONTEXT])][done : done + limit]
        return [(t + self.shift) % self.vocab for t in ahead]

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        original = NgramIndex.propose

        def propose(_index: NgramIndex, tokens: Sequence[int], limit: int) -> list[int]:
            return self.propose(tokens, limit)

        NgramIndex.propose = propose  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            NgramIndex.propose = original  # type: ignore[method-assign]


def engine_for(model: CausalLM, setup: Setup, batch: int, k: int) -> Engine:
    config = decode_config(batch, CONTEXT + setup.longest + 16, num_speculative_tokens=k)
    return Engine(model, None, config)


def prompts(setup: Setup, batch: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(batch)
    draws = torch.randint(3, setup.config.vocab_size, (batch, CONTEXT), generator=gen)
    return [tuple(int(t) for t in row) for row in draws]


def submit_all(engine: Engine, setup: Setup, batch: int, sink: dict[str, list[int]]) -> None:
    sampling = SamplingParams(max_tokens=setup.longest, temperature=0.0, ignore_eos=True)

    def keep(out: RequestOutput) -> None:
        sink.setdefault(out.request_id, []).extend(out.token_ids)

    for i, prompt in enumerate(prompts(setup, batch)):
        engine.submit(GenerateRequest(f"r{i}", prompt, sampling=sampling), keep)


def continuations(model: CausalLM, setup: Setup, batch: int) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy continuation without drafts, as long as the longest run needs."""
    engine = engine_for(model, setup, batch, 0)
    outputs: dict[str, list[int]] = {}
    submit_all(engine, setup, batch, outputs)
    while engine.step():
        pass
    return {p: outputs[f"r{i}"] for i, p in enumerate(prompts(setup, batch))}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(model: CausalLM, setup: Setup, batch: int, k: int, oracle: Oracle) -> dict[str, float]:
    """The median step of `setup.steps` after the prefills and `WARMUP` steps, and the tokens
    a step yielded a sample over those steps."""
    engine = engine_for(model, setup, batch, k)
    outputs: dict[str, list[int]] = {}
    with oracle.installed():
        submit_all(engine, setup, batch, outputs)
        engine.step()  # the prefills: the token budget holds every prompt
        times = []
        for i in range(WARMUP + setup.steps):
            if i == WARMUP:
                before = sum(map(len, outputs.values()))
            synchronize(setup.device)
            began = time.perf_counter()
            if not engine.step():
                raise RuntimeError("the requests finished before the measurement did")
            synchronize(setup.device)
            if i >= WARMUP:
                times.append(time.perf_counter() - began)
    made = sum(map(len, outputs.values())) - before
    ms = statistics.median(times) * 1e3
    return {"step_ms": ms, "tokens_per_step": made / (batch * setup.steps)}


def rows_for(model: CausalLM, weights: str, setup: Setup, batch: int, ks: list[int]) -> list[dict]:
    reference = continuations(model, setup, batch)
    vocab = setup.config.vocab_size
    kept, rejected = Oracle(reference, 0, vocab), Oracle(reference, 1, vocab)
    base = measure(model, setup, batch, 0, kept)
    rows = [{"weights": weights, "batch": batch, "k": 0, "drafts": "-"} | base | {"ratio": 1.0}]
    for k in ks:
        for mode, oracle in zip(MODES, (kept, rejected), strict=True):
            got = measure(model, setup, batch, k, oracle)
            ratio = got["step_ms"] / base["step_ms"]
            rows.append({"weights": weights, "batch": batch, "k": k, "drafts": mode} | got)
            rows[-1]["ratio"] = ratio
    return rows


def table(rows: list[dict], title: str) -> Table:
    out = Table(title=title)
    columns = ("weights", "batch", "k", "drafts", "step ms", "tokens a step", "step / decode's")
    for column in columns:
        out.add_column(column, justify="right")
    for r in rows:
        out.add_row(
            str(r["weights"]),
            str(r["batch"]),
            str(r["k"]),
            str(r["drafts"]),
            f"{r['step_ms']:.2f}",
            f"{r['tokens_per_step']:.2f}",
            f"{r['ratio']:.2f}",
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8], help="draft lengths")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--weights", nargs="+", default=["float32", "bf16"], choices=("float32", "bf16")
    )
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        console.print("needs a CUDA device (or --device cpu): nothing was measured")
        return 2
    shape = SMOLLM2_SHAPED if args.device == "cuda" else TINY_CONFIG
    longest = (WARMUP + args.steps + 2) * (max(args.k) + 1) + 8
    setup = Setup(args.device, shape, args.steps, longest)
    rows: list[dict] = []
    for weights in args.weights:
        model = tiny_model(shape, seed=0).to(args.device)
        model = apply_weight_format(model, weights)
        for batch in args.batches:
            rows.extend(rows_for(model, weights, setup, batch, args.k))
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    console.print(
        table(rows, f"drafted steps on {name}, {shape.num_layers} layers, {CONTEXT}-token prompts")
    )
    print(json.dumps({"device": name, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
