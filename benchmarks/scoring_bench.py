"""What scoring a prompt costs (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`):
the time to a prompt's first token with and without its logprobs, alternated in one process.

    plain    a prompt no request sent before (nothing cached), its first token only
    scored   another such prompt, with prompt_logprobs: every position's logits, log-softmax,
             rank and top-k (a scored prompt reuses nothing from the cache anyway)
    cached   the previous round's plain prompt again: what a scored request gives up

Each round runs every variant once (the order rotating), one request at a time on one engine;
a variant's figure is the median over rounds. Prints a table on stderr and one JSON object on
stdout. Run: `python benchmarks/scoring_bench.py [--model default] [--prompt-tokens 1024]`
(`--model tiny`: the seeded tiny model, for a quick check).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.table import Table

from benchmarks.structured_bench import loaded_model
from cluster.progress import track
from worker.engine import Engine, EngineConfig
from worker.request import GenerateRequest, RequestOutput
from worker.sampling_params import SamplingParams

console = Console(stderr=True)
VARIANTS = ("plain", "scored", "cached")


def prompt(vocab: int, length: int, seed: int) -> tuple[int, ...]:
    """Random ids above the special tokens, the first one the seed's own: no two prompts
    share a prefix at all."""
    rng = random.Random(seed)
    return (4 + seed, *(rng.randrange(3, vocab) for _ in range(length - 1)))


def first_token_s(
    engine: Engine, ids: tuple[int, ...], rid: str, scored: bool, cached: bool = False
) -> float:
    """Seconds to the prompt's first (and only) token; checks what was scored and reused."""
    outputs: list[RequestOutput] = []
    sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1 if scored else None)
    began = time.perf_counter()
    engine.submit(GenerateRequest(rid, prompt_token_ids=ids, sampling=sampling), outputs.append)
    while engine.step():
        pass
    elapsed = time.perf_counter() - began
    assert outputs and outputs[0].finished
    assert (len(outputs[0].prompt_logprobs) == len(ids) - 1) == scored
    assert (outputs[0].cached_prompt_tokens > 0) == cached, "a variant hit or missed the cache"
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="default (SmolLM2), tiny, or a path")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    loaded = loaded_model(args.model)
    pages = 8 * (args.prompt_tokens // 16 + 2)
    config = EngineConfig(num_pages=pages, page_size=16, model_revision=loaded.revision)
    engine = Engine(loaded.model, loaded.tokenizer, config)
    vocab = loaded.config.vocab_size
    first_token_s(engine, prompt(vocab, args.prompt_tokens, -1), "warm-up", scored=True)
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    previous = prompt(vocab, args.prompt_tokens, 0)
    first_token_s(engine, previous, "seed", scored=False)
    for k in track(range(args.rounds), "rounds", console):
        shift = k % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            if variant == "cached":
                ids = previous
            else:
                ids = prompt(vocab, args.prompt_tokens, 2 * k + 1 + (variant == "scored"))
            rid = f"{variant}-{k}"
            seconds[variant].append(
                first_token_s(engine, ids, rid, variant == "scored", variant == "cached")
            )
            if variant == "plain":
                previous = ids
    median = {v: statistics.median(seconds[v]) for v in VARIANTS}
    table = Table(title=f"a {args.prompt_tokens}-token prompt, {args.model}, {args.rounds} rounds")
    for column in ("variant", "s to first token (median)", "min-max", "vs plain"):
        table.add_column(column)
    for variant in VARIANTS:
        table.add_row(
            variant,
            f"{median[variant]:.3f}",
            f"{min(seconds[variant]):.3f}-{max(seconds[variant]):.3f}",
            f"{median[variant] / median['plain']:.2f}x",
        )
    console.print(table)
    result = {
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "rounds": args.rounds,
        "seconds": median,
        "scored_vs_plain": median["scored"] / median["plain"],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
