"""What the prefix cache saves embedding requests: the same inputs with their shared prefix read
from the cache (`shared`), the same without the scheduler's wait for a prefix being computed
(`shared-nowait`: inputs admitted in one step each compute it, as before the twenty-seventh
session), and each input in a namespace of its own, where nothing is shared and every token is
computed, as on a server without a prefix cache (`isolated`).

One in-process engine per run (the worker's engine, real model). Workloads, made of this
repository's docs/ text so that they are real prose:

- `queries`: search queries behind an instruction (how Qwen3-Embedding and e5 are asked to
  embed a query: "Instruct: ...\\nQuery: ..."), about 20 tokens of prefix and 10-30 of query;
- `contextual`: document chunks each behind its document's opening paragraphs (contextual
  retrieval: the chunk embedded in its context), hundreds of tokens of prefix, fewer of chunk;
- `documents`: the chunks alone (nothing shared: what the cache cannot help).

Per run: embeddings a second with every input submitted at once (the engine batches them),
the median latency of inputs sent one at a time, and the prompt tokens computed (not read from
the cache). Runs alternate the modes within each round (the order rotating); reported per
(workload, mode) as the median and min-max over rounds, with the largest relative difference
between a mode's embeddings and the first mode's of the same inputs (the cache must not change
them beyond float rounding). One JSON line per run, then a table.

Run: `python benchmarks/embedding_bench.py [--model default|tiny|PATH] [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from benchmarks.model_source import model_source
from cache import CacheNamespace
from worker.engine import Engine, EngineConfig
from worker.loader import LoadedModel, load_model
from worker.request import GenerateRequest, PoolingParams, RequestOutput

console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)
ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("queries", "contextual", "documents")
MODES = ("shared", "shared-nowait", "isolated")
INSTRUCTION = (
    "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "
)


def paragraphs() -> list[str]:
    """Prose paragraphs of docs/ (no tables, lists or code), in a fixed order."""
    found = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for block in path.read_text().split("\n\n"):
            text = " ".join(block.split())
            if 300 <= len(text) <= 1200 and text[0].isalpha() and "|" not in text:
                found.append(text)
    return found


def workload(name: str, count: int, context_chars: int = 1800) -> list[str]:
    """`count` inputs of the workload, each different; `contextual`'s shared context is the
    first `context_chars` characters of the document."""
    texts = paragraphs()
    if name == "queries":
        sentences = [s.strip() for t in texts for s in t.split(". ") if 40 <= len(s) <= 160]
        return [INSTRUCTION + sentences[i % len(sentences)] + "?" for i in range(count)]
    context = " ".join(texts[:3])[:context_chars]  # a document's opening, before each chunk
    chunks = [texts[3 + i % (len(texts) - 3)][:400] for i in range(count)]
    if name == "contextual":
        return [f"<document>{context}</document>\n<chunk>{chunk}</chunk>" for chunk in chunks]
    return chunks


@dataclass
class EmbeddingRun:
    loaded: LoadedModel
    name: str
    mode: str
    inputs: list[str]
    latency_inputs: int

    def engine(self) -> Engine:
        config = EngineConfig(
            num_pages=2048, page_size=16, max_running=32, token_budget=4096, max_prefill_chunk=2048
        )
        engine = Engine(self.loaded.model, self.loaded.tokenizer, config)
        if self.mode == "shared-nowait":
            engine.scheduler.config = replace(engine.scheduler.config, in_batch_shared=0)
        return engine

    def request(self, i: int, text: str) -> GenerateRequest:
        tenant = f"input-{i}" if self.mode == "isolated" else None  # a namespace of its own
        return GenerateRequest(
            f"{self.name}-{i}", prompt=text, namespace=CacheNamespace(tenant=tenant),
            pooling=PoolingParams(),
        )  # fmt: skip

    def __call__(self, progress: Progress) -> dict[str, object]:
        task = progress.add_task(f"{self.name} {self.mode}", total=len(self.inputs))
        engine = self.engine()
        latencies = []
        for i, text in enumerate(self.inputs[: self.latency_inputs]):  # one at a time
            outputs: list[RequestOutput] = []
            began = time.perf_counter()
            engine.submit(self.request(i, f"{text} (latency)"), outputs.append)
            while not outputs:
                engine.step()
            latencies.append(time.perf_counter() - began)
        engine = self.engine()  # a cold cache again for the batch
        done: dict[str, RequestOutput] = {}
        began = time.perf_counter()
        for i, text in enumerate(self.inputs):
            engine.submit(self.request(i, text), lambda out: done.__setitem__(out.request_id, out))
        while engine.step():
            progress.update(task, completed=len(done))
        seconds = time.perf_counter() - began
        progress.remove_task(task)
        outputs = [done[f"{self.name}-{i}"] for i in range(len(self.inputs))]
        prompt = sum(o.prompt_tokens for o in outputs)
        self.vectors = [torch.tensor(o.embedding) for o in outputs]
        return {
            "workload": self.name,
            "mode": self.mode,
            "inputs": len(outputs),
            "embeddings_per_s": len(outputs) / seconds,
            "latency_ms_p50": statistics.median(latencies) * 1e3,
            "prompt_tokens": prompt,
            "computed_tokens": prompt - sum(o.cached_prompt_tokens for o in outputs),
        }


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).norm() / y.norm()) for x, y in zip(a, b, strict=True))


def table(reports: list[dict[str, object]], rounds: int) -> Table:
    out = Table(title=f"embeddings, median (min-max) of {rounds} rounds")
    columns = ("workload", "mode", "embeddings/s", "latency p50 ms", "tokens computed", "of")
    for column in (*columns, "largest difference"):
        out.add_column(column, justify="right")
    for name in WORKLOADS:
        for mode in MODES:
            mine = [r for r in reports if r["workload"] == name and r["mode"] == mode]
            if not mine:
                continue
            cells = []
            for key, digits in (("embeddings_per_s", 1), ("latency_ms_p50", 1)):
                values = [float(r[key]) for r in mine]  # type: ignore[arg-type]
                mid, lo, hi = statistics.median(values), min(values), max(values)
                cells.append(f"{mid:,.{digits}f} ({lo:,.{digits}f}-{hi:,.{digits}f})")
            diff = max(float(r.get("largest_difference", 0.0)) for r in mine)  # type: ignore[arg-type]
            out.add_row(
                name, mode, *cells, f"{mine[0]['computed_tokens']:,}",
                f"{mine[0]['prompt_tokens']:,}", f"{diff:.1e}",
            )  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2), 'tiny' or a path")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--inputs", type=int, default=64, help="inputs a run, all at once")
    parser.add_argument("--latency-inputs", type=int, default=8, help="inputs sent one at a time")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--context-chars", type=int, default=1800, help="contextual's prefix")
    args = parser.parse_args(argv)
    loaded = load_model(model_source(args.model))
    reports = []
    with Progress(console=console, transient=True) as progress:
        for round_ in range(args.rounds):
            for name in args.workloads:
                inputs = workload(name, args.inputs, args.context_chars)
                runs = []
                for mode in MODES[round_ % len(MODES) :] + MODES[: round_ % len(MODES)]:
                    run = EmbeddingRun(loaded, name, mode, inputs, args.latency_inputs)
                    runs.append((run, run(progress) | {"round": round_, "model": args.model}))
                for run, report in runs:
                    report["largest_difference"] = largest_difference(
                        run.vectors, runs[0][0].vectors
                    )
                    reports.append(report)
                    print(json.dumps(report), flush=True)
    console.print(table(reports, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
