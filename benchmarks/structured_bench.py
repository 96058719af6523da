"""What a structured output costs a request: decode time per token with and without a
constraint, alternated in one process, and the one-time cost of the first structured request
(xgrammar's import and the vocabulary's tables) on a fresh engine.

    free    the chat answered as free text (ignore_eos, so every run decodes --tokens tokens)
    json    the same chat under a JSON schema of one long string field
    tools   the same chat with two tools and tool_choice "required" (Hermes's <tool_call> format)

Each round runs every variant once, greedily, on the same engine (the grammars compiled in the
first round are reused, as a serving worker reuses them); a variant's figure is the median over
rounds of its median gap between two tokens. Prints a table on stderr and one JSON object on
stdout. Run: `python benchmarks/structured_bench.py [--model default] [--tokens 64]`
(`--model tiny`: the seeded tiny model, for a quick check).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

from rich.console import Console
from rich.table import Table

from benchmarks.model_source import model_source
from cluster.progress import track
from worker.engine import Engine, EngineConfig
from worker.loader import LoadedModel, load_model
from worker.request import GenerateRequest, RequestOutput
from worker.sampling_params import SamplingParams, StructuredOutput
from worker.tool_calls import Tool, tool_constraint

console = Console(stderr=True)
VARIANTS = ("free", "json", "tools")
CHAT = ({"role": "user", "content": "Tell me a long story about a cache that never forgets."},)
STORY = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "story": {"type": "string"}},
    "required": ["title", "story"],
}
TOOLS = (
    Tool(
        "get_weather",
        "The forecast for a city",
        json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}),
    ),
    Tool(
        "search",
        "Search the web",
        json.dumps({"type": "object", "properties": {"q": {"type": "string"}}}),
    ),
)


def loaded_model(name: str) -> LoadedModel:
    return load_model(model_source(name))


def request(variant: str, tokens: int, rid: str) -> GenerateRequest:
    structured = None
    tools: tuple[Tool, ...] = ()
    if variant == "json":
        structured = StructuredOutput("json_schema", json.dumps(STORY))
    elif variant == "tools":
        tools = TOOLS
        structured = tool_constraint(TOOLS, "required")
    sampling = SamplingParams(
        max_tokens=tokens, temperature=0.0, ignore_eos=variant == "free", structured=structured
    )
    return GenerateRequest(rid, messages=CHAT, sampling=sampling, tools=tools)


def timed(engine: Engine, generate: GenerateRequest) -> tuple[float, list[float], str]:
    """(seconds to the first token, the gaps between tokens, the text)."""
    stamps: list[float] = []
    outputs: list[RequestOutput] = []

    def sink(output: RequestOutput) -> None:
        stamps.extend([time.perf_counter()] * len(output.token_ids))
        outputs.append(output)

    began = time.perf_counter()
    engine.submit(generate, sink)
    while engine.step():
        pass
    gaps = [b - a for a, b in itertools.pairwise(stamps) if b > a]
    return stamps[0] - began, gaps, "".join(o.text for o in outputs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="default (SmolLM2), tiny, or a path")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    loaded = loaded_model(args.model)
    config = EngineConfig(num_pages=256, page_size=16, model_revision=loaded.revision)
    engine = Engine(loaded.model, loaded.tokenizer, config)
    began = time.perf_counter()
    first_ttft, _, _ = timed(engine, request("json", 2, "first"))
    setup = time.perf_counter() - began
    warm_ttft, _, _ = timed(engine, request("json", 2, "second"))
    gaps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    counts: dict[str, list[int]] = {v: [] for v in VARIANTS}
    samples: dict[str, str] = {}
    rounds = range(args.rounds)
    for k in track(rounds, "rounds", console):
        for variant in VARIANTS:
            _, between, text = timed(engine, request(variant, args.tokens, f"{variant}-{k}"))
            gaps[variant].append(statistics.median(between) if between else 0.0)
            counts[variant].append(len(between) + 1)
            samples[variant] = text
    ms = {v: statistics.median(gaps[v]) * 1000 for v in VARIANTS}
    table = Table(title=f"decode per token, {args.model}, median of {args.rounds} rounds")
    for column in ("variant", "ms / token", "vs free", "tokens", "text (last round)"):
        table.add_column(column)
    for variant in VARIANTS:
        table.add_row(
            variant,
            f"{ms[variant]:.2f}",
            f"{ms[variant] / ms['free']:.3f}x" if ms["free"] else "-",
            str(statistics.median(counts[variant])),
            samples[variant][:60].replace("\n", "\\n"),
        )
    console.print(table)
    console.print(
        f"first structured request on a fresh engine: {first_ttft:.3f} s to its first token "
        f"(xgrammar imported, vocabulary tables built, schema compiled); the same again: "
        f"{warm_ttft:.3f} s"
    )
    result = {
        "model": args.model,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "ms_per_token": ms,
        "tokens_decoded": {v: statistics.median(counts[v]) for v in VARIANTS},
        "first_structured_ttft_s": first_ttft,
        "first_request_s": setup,
        "warm_structured_ttft_s": warm_ttft,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
