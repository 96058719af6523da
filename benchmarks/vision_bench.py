"""What caching an image saves: TTFT of a follow-up turn that re-sends the image (issue 18).

A conversation about one image, through the engine (no network), greedy, CPU:

- turn 1: the first turn's prompt (the image, a question) on an empty engine;
- cold: the follow-up turn's whole prompt (turn 1, its answer, a second question) on an empty
  engine, so the encoder and the prefill of every position run;
- follow-up: the same prompt on the engine that served turn 1: the image's KV is cached, and
  neither the vision encoder nor the prefill of the image positions runs again;
- encoder cache: the same prompt after the engine's KV was evicted (the tree emptied) while the
  encoder-output cache keeps the image: the prefill runs, the vision encoder does not;
- no encoder cache: the same again with `encoder_cache_bytes = 0` (the encoder reruns too).

TTFT is the time from `submit` to the first output, the engine stepped on this thread. Each row
is the median of `--repeats` conversations, each on fresh engines. The target (issue 18): the
follow-up <= 15 % of cold when the image is most of the prompt.

Models (random weights, built here with transformers, which the benchmark needs):
- `tiny`: tests/worker/vlm_fixtures.py's tiny Idefics3 (tile 32, 4 positions a tile);
- `smolvlm-256m`: SmolVLM-256M-Instruct's shape (SigLIP 12 x 768 on 512-pixel tiles, 64
  positions a tile, SmolLM2-135M's text model; the head cut to the tiny tokenizer's 552 ids),
  with `--longest-edge` (default 512: one frame; the real processor's 2048 makes 13-17 frames
  of ~2-3 s each on this CPU).

Prints a table, and one JSON object per model (and --output).
Run: `python benchmarks/vision_bench.py [--models tiny smolvlm-256m] [--repeats 3]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.table import Table

from cluster.progress import progress_bar
from worker.engine import Engine, EngineConfig
from worker.loader import LoadedModel, load_model
from worker.request import GenerateRequest, RequestOutput
from worker.sampling_params import SamplingParams

console = Console(stderr=True, width=None if sys.stderr.isatty() else 130)
MODELS = ("tiny", "smolvlm-256m")
QUESTIONS = ("Describe this picture in detail.", "What else can you see in it?")
ANSWER_TOKENS = 12
CASES = ("turn1", "cold", "follow_up", "encoder_cache", "no_encoder_cache")


def build(model: str, directory: Path, longest_edge: int) -> Path:
    from tests.worker.vlm_fixtures import (
        IMAGE_SPECIAL_TOKENS,
        TEXT_VOCAB,
        build_tiny_vlm,
        save_vlm,
        smolvlm_256m_config,
    )

    if model == "tiny":
        return build_tiny_vlm(directory / "tiny", seed=3, tile=32, longest_edge=longest_edge)
    config = smolvlm_256m_config()
    # The tokenizer is the tiny one (552 tokens): a random model must only draw ids it can spell.
    # Only the head's rows shrink (49,280 -> 552), and prefill computes the head for one row.
    config.text_config.vocab_size = TEXT_VOCAB + len(IMAGE_SPECIAL_TOKENS)
    return save_vlm(directory / "smolvlm-256m", config, seed=3, longest_edge=longest_edge)


def image_bytes(width: int, height: int) -> bytes:
    from tests.worker.vlm_fixtures import png_bytes

    return png_bytes(width, height, seed=7)


class Conversation:
    """One image, two turns: the requests and what each run of them reported."""

    def __init__(self, loaded: LoadedModel, image: bytes) -> None:
        self.loaded, self.image = loaded, image
        self.turn1 = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[0]}]}
        ]

    def request(
        self, request_id: str, messages: list[dict[str, Any]], tokens: int
    ) -> GenerateRequest:
        sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        return GenerateRequest(
            request_id, messages=tuple(messages), images=(self.image,), sampling=sampling
        )

    def engine(self, encoder_cache_bytes: int = 64 << 20) -> Engine:
        config = EngineConfig(
            num_pages=4096, page_size=16, block_size=16, encoder_cache_bytes=encoder_cache_bytes
        )
        loaded = self.loaded
        return Engine(loaded.model, loaded.tokenizer, config, vision=loaded.vision)

    def follow_up(self, answer: list[int]) -> list[dict[str, Any]]:
        assert self.loaded.tokenizer is not None
        text = self.loaded.tokenizer.decode(answer)
        return [
            *self.turn1,
            {"role": "assistant", "content": [{"type": "text", "text": text}]},
            {"role": "user", "content": [{"type": "text", "text": QUESTIONS[1]}]},
        ]


def run(engine: Engine, request: GenerateRequest) -> tuple[float, list[RequestOutput]]:
    """TTFT in seconds, and every output once the request finished."""
    outputs: list[RequestOutput] = []
    began = time.perf_counter()
    engine.submit(request, outputs.append)
    ttft = None
    while engine.step() or not outputs or not outputs[-1].finished:
        if ttft is None and outputs:
            ttft = time.perf_counter() - began
    if ttft is None:
        ttft = time.perf_counter() - began
    error = outputs[-1].error
    if error is not None:
        raise RuntimeError(f"{request.request_id} failed: {error}")
    return ttft, outputs


def one_round(talk: Conversation, n: int) -> dict[str, dict[str, float]]:
    """Each case once, on fresh engines: {case: {ttft, cached, prompt, encoder_runs, ...}}."""
    rows: dict[str, dict[str, float]] = {}

    def record(case: str, engine: Engine, ttft: float, outputs: list[RequestOutput]) -> None:
        stats = engine.stats()
        rows[case] = {
            "ttft_s": ttft,
            "prompt_tokens": outputs[-1].prompt_tokens,
            "cached_tokens": outputs[-1].cached_prompt_tokens,
            "encoder_runs": stats.encoder_runs,
            "encoder_cache_hits": stats.encoder_cache_hits,
            "encoder_s": stats.encoder_seconds,
        }

    warm = talk.engine()
    ttft, outputs = run(warm, talk.request(f"t1-{n}", talk.turn1, ANSWER_TOKENS))
    record("turn1", warm, ttft, outputs)
    follow = talk.follow_up([t for o in outputs for t in o.token_ids])

    cold = talk.engine()
    record("cold", cold, *run(cold, talk.request(f"cold-{n}", follow, 1)))
    before = warm.stats()
    ttft, outputs = run(warm, talk.request(f"t2-{n}", follow, 1))
    record("follow_up", warm, ttft, outputs)
    rows["follow_up"]["encoder_runs"] -= before.encoder_runs  # this turn's own
    rows["follow_up"]["encoder_s"] -= before.encoder_seconds

    for case, cache_bytes in (("encoder_cache", 64 << 20), ("no_encoder_cache", 0)):
        engine = talk.engine(cache_bytes)
        run(engine, talk.request(f"{case}-warm-{n}", talk.turn1, 1))
        tree = engine.cache.tree
        tree.evict(tree.evictable_pages)  # the KV goes; the encoder cache (if any) keeps the image
        before = engine.stats()
        ttft, outputs = run(engine, talk.request(f"{case}-{n}", follow, 1))
        record(case, engine, ttft, outputs)
        rows[case]["encoder_runs"] -= before.encoder_runs
        rows[case]["encoder_cache_hits"] -= before.encoder_cache_hits
        rows[case]["encoder_s"] -= before.encoder_seconds
    return rows


def measure(model: str, repeats: int, longest_edge: int, size: tuple[int, int]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vision-bench-") as tmp:
        console.print(f"[dim]building {model} (random weights)...[/dim]")
        loaded = load_model(build(model, Path(tmp), longest_edge))
    assert loaded.vision is not None
    talk = Conversation(loaded, image_bytes(*size))
    spec = loaded.vision.spec
    frames = spec.tiles(*size)
    rounds = []
    with progress_bar(console=console, transient=True) as progress:
        task = progress.add_task(f"{model}: conversations", total=repeats + 1)
        one_round(talk, -1)  # warm-up: first calls into torch, allocator
        progress.advance(task)
        for n in range(repeats):
            rounds.append(one_round(talk, n))
            progress.advance(task)
    cases = {
        case: {key: statistics.median(r[case][key] for r in rounds) for key in rounds[0][case]}
        for case in CASES
    }
    cold = cases["cold"]["ttft_s"]
    return {
        "model": model,
        "image_size": list(size),
        "frames": frames,
        "image_positions": frames * spec.image_seq_len,
        "follow_up_prompt_tokens": cases["follow_up"]["prompt_tokens"],
        "repeats": repeats,
        "cases": cases,
        "follow_up_over_cold": cases["follow_up"]["ttft_s"] / cold,
        "follow_up_over_turn1": cases["follow_up"]["ttft_s"] / cases["turn1"]["ttft_s"],
        "encoder_cache_over_cold": cases["encoder_cache"]["ttft_s"] / cold,
        "encoder_seconds_saved": cases["no_encoder_cache"]["encoder_s"]
        - cases["encoder_cache"]["encoder_s"],
    }


def report(results: list[dict[str, Any]]) -> Table:
    table = Table(title="TTFT of a follow-up turn that re-sends its image (median)")
    for column in (
        "model",
        "frames / image positions",
        "prompt",
        "case",
        "TTFT ms",
        "of cold",
        "cached",
        "encoder runs",
        "encoder ms",
    ):
        table.add_column(column, justify="left" if column in ("model", "case") else "right")
    for result in results:
        cold = result["cases"]["cold"]["ttft_s"]
        for case in CASES:
            row = result["cases"][case]
            table.add_row(
                result["model"],
                f"{result['frames']} / {result['image_positions']}",
                str(int(row["prompt_tokens"])),
                case,
                f"{row['ttft_s'] * 1e3:.1f}",
                f"{row['ttft_s'] / cold:.1%}",
                str(int(row["cached_tokens"])),
                str(int(row["encoder_runs"])),
                f"{row['encoder_s'] * 1e3:.1f}",
            )
        table.add_section()
    return table


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--longest-edge",
        type=int,
        default=None,
        help="the processor's size.longest_edge (default: 128 for tiny, 512 for smolvlm-256m)",
    )
    parser.add_argument("--image-size", type=int, nargs=2, default=(640, 480), metavar=("W", "H"))
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    results = []
    for model in args.models:
        edge = args.longest_edge or (128 if model == "tiny" else 512)
        results.append(measure(model, args.repeats, edge, tuple(args.image_size)))
        out(json.dumps(results[-1]))
    console.print(report(results))
    if args.output is not None:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
