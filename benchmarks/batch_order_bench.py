"""What running a batch in prefix order saves: the same batch file run by `router.batch_order:
file` (the file's order) and `prefix` (sorted by prompt), on clusters whose KV pools hold a few
of the batch's documents at a time.

The batch is document question answering, the shape of most offline work on a served model:
`--documents` documents (prose paragraphs of this repository's docs/, joined to about
`--document-chars`), each asked `--questions` questions, one chat request each (the document in
the system message, the question in the user's), the requests shuffled in the file (`--seed`)
as a file built from a database or a log would have them. Each worker's pool is sized to hold
about `--pool-documents` of the documents' prompts.

One in-process cluster per run (tests/cluster/local_cluster.py: real engines behind real gRPC,
the router and its HTTP API on loopback), the batch run through the `openai` SDK's Files and
Batch calls. Runs alternate the two orders within each round (which goes first alternating).
Reported per order: the batch's wall time, its prompt tokens served from cache (the batch's
`usage.input_tokens_details.cached_tokens`), the tokens computed, and requests a second, as the
median and min-max over rounds. One JSON line per run, then a table.

Run: `python benchmarks/batch_order_bench.py [--model tiny|default] [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from benchmarks.embedding_bench import paragraphs
from benchmarks.model_source import model_source
from cluster.config import RouterSection
from tests.cluster.local_cluster import ENGINE, SERVED_NAME, start_cluster
from worker.loader import LoadedModel, load_model

console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)
ORDERS = ("file", "prefix")
QUESTIONS = (
    "What is this about?",
    "Name one thing it measures.",
    "What would fail first?",
    "Who would use this?",
    "What is left out?",
    "Summarise it in five words.",
)


def documents(count: int, chars: int) -> list[str]:
    """`count` different documents of about `chars` characters each."""
    texts = paragraphs()
    out, at = [], 0
    for _ in range(count):
        document = ""
        while len(document) < chars:
            document += texts[at % len(texts)] + " "
            at += 1
        out.append(document[:chars])
    return out


def batch_lines(docs: list[str], questions: int, seed: int, max_tokens: int) -> list[str]:
    """The batch file's lines, shuffled."""
    lines = []
    for d, document in enumerate(docs):
        for q in range(questions):
            messages = [
                {"role": "system", "content": f"Answer from this document.\n\n{document}"},
                {"role": "user", "content": QUESTIONS[q % len(QUESTIONS)]},
            ]
            body = {
                "model": SERVED_NAME,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            request = {"custom_id": f"d{d}-q{q}", "method": "POST", "body": body}
            lines.append(json.dumps(request | {"url": "/v1/chat/completions"}))
    random.Random(seed).shuffle(lines)
    return lines


def prompt_tokens(loaded: LoadedModel, document: str) -> int:
    assert loaded.tokenizer is not None
    return len(loaded.tokenizer.encode(f"Answer from this document.\n\n{document}"))


def run_once(
    loaded: LoadedModel, order: str, lines: list[str], pages: int, workers: int
) -> dict[str, Any]:
    router = RouterSection(port=0, batch_order=order)
    engine = replace(ENGINE, num_pages=pages, max_model_len=4096, max_running=16)
    cluster = start_cluster(loaded, workers=workers, http=True, router=router, engine=engine)
    try:
        client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="-", max_retries=0)
        content = ("\n".join(lines) + "\n").encode()
        file_id = client.files.create(file=("batch.jsonl", content), purpose="batch").id
        began = time.perf_counter()
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        while batch.status not in ("completed", "failed", "cancelled"):
            time.sleep(0.02)
            batch = client.batches.retrieve(batch.id)
        seconds = time.perf_counter() - began
        failed = client.files.content(batch.error_file_id).text if batch.error_file_id else ""
    finally:
        cluster.close()
    assert batch.status == "completed" and not failed, failed[:2000] or batch
    usage = batch.usage
    cached = usage.input_tokens_details.cached_tokens
    return {
        "order": order,
        "requests": batch.request_counts.completed,
        "seconds": seconds,
        "requests_per_s": batch.request_counts.completed / seconds,
        "prompt_tokens": usage.input_tokens,
        "cached_tokens": cached,
        "computed_tokens": usage.input_tokens - cached,
        "cached_share": cached / usage.input_tokens,
    }


def table(reports: list[dict[str, Any]]) -> Table:
    out = Table(title="batch order: median (min-max) over rounds")
    for column in ("order", "seconds", "requests/s", "cached share", "tokens computed"):
        out.add_column(column, justify="right")

    def cell(values: list[float], form: str) -> str:
        return f"{statistics.median(values):{form}} ({min(values):{form}}-{max(values):{form}})"

    for order in ORDERS:
        mine = [r for r in reports if r["order"] == order]
        out.add_row(
            order,
            cell([r["seconds"] for r in mine], ".2f"),
            cell([r["requests_per_s"] for r in mine], ".1f"),
            cell([r["cached_share"] for r in mine], ".1%"),
            cell([r["computed_tokens"] for r in mine], ".0f"),
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2), 'tiny' or a path")
    parser.add_argument("--documents", type=int, default=24)
    parser.add_argument("--questions", type=int, default=4, help="questions per document")
    parser.add_argument("--document-chars", type=int, default=1500)
    parser.add_argument("--pool-documents", type=float, default=3.0, help="a pool holds this many")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    loaded = load_model(model_source(args.model))
    docs = documents(args.documents, args.document_chars)
    lines = batch_lines(docs, args.questions, args.seed, args.max_tokens)
    longest = max(prompt_tokens(loaded, d) for d in docs) + 64  # the template, the question
    pages = int(args.pool_documents * longest / ENGINE.page_size) + 1
    reports = []
    with Progress(console=console) as progress:
        task = progress.add_task("batches", total=args.rounds * len(ORDERS))
        for round_ in range(args.rounds):
            orders = ORDERS if round_ % 2 == 0 else ORDERS[::-1]
            for order in orders:
                report = run_once(loaded, order, lines, pages, args.workers)
                report |= {"round": round_, "pages": pages, "documents": args.documents}
                print(json.dumps(report), flush=True)
                reports.append(report)
                progress.advance(task)
    console.print(table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
