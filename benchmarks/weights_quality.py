"""What a weight format costs in quality: log-likelihood of a held-in text and greedy agreement,
each format against float32 weights of the same checkpoint.

For each format in --formats (float32 first: the reference), `load_model(source, weights=fmt)`,
exactly what a worker serving `model.weights: fmt` holds, then:

- **log-likelihood**: the text in benchmarks/data/held_in_text.txt (public-domain US documents,
  ~3,600 SmolLM2 tokens) as one sequence, prefilled through the engine's paged KV cache in
  chunks of --chunk tokens with logits at every position: the mean log-probability per token of
  each next token, the perplexity exp(-mean), and against float32 the relative perplexity
  increase exp(mean_f32 - mean_fmt) - 1 with the standard error of the paired per-token
  difference (the same tokens in every format: the noise left is the text's, not the model's);
- **greedy agreement**: 20 fixed chat prompts, --new-tokens tokens each, greedy, through the
  engine (all 20 in one batch): per prompt the position of the first token that differs from
  float32's (new_tokens when none does), and the share of identical tokens position by position;
- **verdict**: worker/weight_quality.py's threshold on the perplexity increase (the worker refuses
  a format measured past it for this checkpoint; the docstring there says why the threshold is
  what it is).

Prints a table on stderr and one JSON object on stdout (and --output).
Run: `python benchmarks/weights_quality.py [--source default] [--formats float32 bf16 int8 int4]`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from rich.console import Console
from rich.table import Table

from worker.engine import Engine, EngineConfig
from worker.loader import LoadedModel, load_model
from worker.model import CausalLM
from worker.model_runner import Chunk, ModelRunner
from worker.quantized_weights import WEIGHT_FORMATS
from worker.request import GenerateRequest
from worker.sampling_params import SamplingParams
from worker.tokenizer import Tokenizer
from worker.weight_formats import check_weight_format, weight_bytes
from worker.weight_quality import MAX_PERPLEXITY_INCREASE, acceptable

console = Console(stderr=True, width=160)
HELD_IN = Path(__file__).resolve().parent / "data" / "held_in_text.txt"
PAGE_SIZE = 16
PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Explain photosynthesis in one paragraph.",
    "Write a haiku about the ocean.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "List the planets of the solar system in order.",
    "What causes the seasons on Earth?",
    "Describe how a bicycle works.",
    "What is the difference between a virus and a bacterium?",
    "Write a short email asking a colleague for a meeting.",
    "How do I make a cup of tea?",
    "What is machine learning?",
    "Name three famous painters and one work by each.",
    "Explain what a prime number is, with examples.",
    "Write a limerick about a cat.",
    "What should I pack for a weekend hiking trip?",
)


def held_in_text(path: Path = HELD_IN) -> str:
    """The text after the file's header (the '#' lines before the first blank line)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = 0
    while start < len(lines) and lines[start].startswith("#"):
        start += 1
    if start == len(lines) or lines[start].strip():
        raise ValueError(f"{path}: expected '#' header lines, then a blank line, then the text")
    return "\n".join(lines[start + 1 :]) + "\n"


def token_logprobs(model: CausalLM, ids: list[int], chunk: int) -> torch.Tensor:
    """float64 [len(ids) - 1]: log p(ids[i] | ids[:i]) for i >= 1, the whole text as one
    sequence prefilled `chunk` tokens at a time over its cached prefix (the serving path)."""
    pages = -(-len(ids) // PAGE_SIZE)
    runner = ModelRunner(model, num_pages=pages + 1, page_size=PAGE_SIZE)
    row = list(range(1, pages + 1))
    out = []
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start : min(start + chunk, len(ids) - 1)]
        batch = runner.build_batch([Chunk(piece, start, row, True)])
        every_row = torch.arange(len(piece), device=batch.input_ids.device)
        logits = model(replace(batch, logits_indices=every_row), runner.kv)
        targets = torch.tensor(ids[start + 1 : start + 1 + len(piece)], device=logits.device)
        logp = torch.log_softmax(logits.double(), dim=-1)
        out.append(logp.gather(1, targets[:, None])[:, 0].cpu())
    return torch.cat(out)


def prompt_ids(tokenizer: Tokenizer) -> list[list[int]]:
    """The 20 prompts as the model sees them: its chat template, one user turn."""
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": text}]),
            add_special_tokens=False,
        )
        for text in PROMPTS
    ]


def greedy(model: CausalLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's `new_tokens` greedy tokens (end of sequence ignored), all in one batch."""
    longest = max(len(p) for p in prompts) + new_tokens
    config = EngineConfig(
        num_pages=len(prompts) * (-(-longest // PAGE_SIZE) + 1) + 8,
        page_size=PAGE_SIZE,
        max_running=len(prompts),
        token_budget=sum(len(p) for p in prompts) + len(prompts),
        max_prefill_chunk=longest,
        max_model_len=longest + PAGE_SIZE,
    )
    engine = Engine(model, None, config)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        sink = tokens[i].extend
        engine.submit(
            GenerateRequest(f"p{i}", tuple(prompt), sampling=sampling),
            lambda output, sink=sink: sink(output.token_ids),  # type: ignore[misc]
        )
    while engine.step():
        pass
    return [tokens[i] for i in range(len(prompts))]


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """Per prompt: the first position where `other` differs from `reference` (the length when
    never) and the share of positions holding the same token."""
    first, same = [], []
    for ref, out in zip(reference, other, strict=True):
        diverged = [i for i, (a, b) in enumerate(zip(ref, out, strict=True)) if a != b]
        first.append(diverged[0] if diverged else len(ref))
        same.append(1 - len(diverged) / len(ref))
    return {
        "first_divergence": first,
        "first_divergence_median": statistics.median(first),
        "identical_prompts": sum(f == len(r) for f, r in zip(first, reference, strict=True)),
        "identical_token_share": statistics.fmean(same),
    }


def measure_format(
    loaded: LoadedModel, ids: list[int], prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    began = time.perf_counter()
    logp = token_logprobs(loaded.model, ids, args.chunk)
    scored = time.perf_counter()
    tokens = greedy(loaded.model, prompts, args.new_tokens)
    return {
        "weight_mb": weight_bytes(loaded.model) / 1e6,
        "mean_logprob": float(logp.mean()),
        "perplexity": math.exp(-float(logp.mean())),
        "logprob_seconds": scored - began,
        "greedy_seconds": time.perf_counter() - scored,
        "_logprobs": logp,
        "_tokens": tokens,
    }


def compare(reference: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """The row against float32's: perplexity increase with its standard error, agreement."""
    diff = reference["_logprobs"] - row["_logprobs"]  # per token: how much likelier under f32
    n = diff.numel()
    mean = float(diff.mean())
    stderr = float(diff.std()) / math.sqrt(n) if n > 1 else 0.0
    increase = math.expm1(mean)
    return {
        "perplexity_increase": increase,
        "perplexity_increase_stderr": math.exp(mean) * stderr,
        "acceptable": acceptable(increase),
        **agreement(reference["_tokens"], row["_tokens"]),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    formats = [check_weight_format(f, "--formats") for f in args.formats]
    if formats[0] != "float32":
        raise ValueError("--formats must start with float32: the reference the others meet")
    rows: dict[str, dict[str, Any]] = {}
    ids: list[int] = []
    prompts: list[list[int]] = []
    for fmt in formats:
        console.print(f"[bold]{args.source}[/]: {fmt}")
        loaded = load_model(args.source, weights=fmt)
        if loaded.tokenizer is None:
            raise ValueError(f"{args.source}: a checkpoint without a tokenizer cannot read text")
        if not ids:
            ids = loaded.tokenizer.encode(held_in_text(args.text), add_special_tokens=False)
            ids = ids[: args.max_text_tokens] if args.max_text_tokens else ids
            prompts = prompt_ids(loaded.tokenizer)[: args.prompts]
        rows[fmt] = measure_format(loaded, ids, prompts, args)
        del loaded
    reference = rows["float32"]
    for row in rows.values():
        row.update(compare(reference, row))
    for row in rows.values():
        del row["_logprobs"], row["_tokens"]
    return {
        "source": args.source,
        "text": str(args.text),
        "text_tokens": len(ids),
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "torch_threads": torch.get_num_threads(),
        "max_perplexity_increase": MAX_PERPLEXITY_INCREASE,
        "formats": rows,
    }


def report(result: dict[str, Any]) -> Table:
    table = Table(
        title=f"{result['source']}: {result['text_tokens']} held-in tokens, "
        f"{result['prompts']} prompts x {result['new_tokens']} greedy tokens, against float32 "
        f"(threshold: perplexity +{result['max_perplexity_increase']:.1%})"
    )
    columns = (
        "weights",
        "MB",
        "log-lik / token",
        "perplexity",
        "ppl increase",
        "identical tokens",
        "identical prompts",
        "first divergence (median)",
        "verdict",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for fmt, row in result["formats"].items():
        table.add_row(
            fmt,
            f"{row['weight_mb']:.0f}",
            f"{row['mean_logprob']:.4f}",
            f"{row['perplexity']:.3f}",
            f"{row['perplexity_increase']:+.2%} +- {row['perplexity_increase_stderr']:.2%}",
            f"{row['identical_token_share']:.1%}",
            f"{row['identical_prompts']}/{result['prompts']}",
            f"{row['first_divergence_median']:g}",
            "keeps quality" if row["acceptable"] else "REFUSED",
        )
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="default", help="'default', a checkpoint dir, .gguf")
    parser.add_argument("--formats", nargs="+", default=list(WEIGHT_FORMATS))
    parser.add_argument("--text", type=Path, default=HELD_IN)
    parser.add_argument("--max-text-tokens", type=int, default=0, help="0: the whole text")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens)")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run(args)
    console.print(report(result))
    print(json.dumps(result))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
