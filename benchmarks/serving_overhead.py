"""What the serving path costs: TTFT and per-token time through Ray + gRPC vs the engine itself.

The same requests, one at a time, go (1) to an in-process engine, timed from `submit` to each
output, and (2) through a real Ray cluster: the client -> router actor -> worker actor, both
over gRPC on loopback, timed at the client. Same model, same engine configuration, a fresh cache
each. Reported: p50 / p90 TTFT and inter-token time of both, and their differences (the
overhead). The default model is the built-in tiny one, whose fast forward pass leaves the
overhead visible; `--model default` uses SmolLM2.

Run: `python benchmarks/serving_overhead.py [--requests 40] [--tokens 32] [--model default]`.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

from rich.console import Console
from rich.progress import track
from rich.table import Table

from cluster.client import Client, text_request
from cluster.config import (
    ClusterConfig,
    EngineSection,
    MetricsSection,
    ModelSection,
    RouterSection,
    WorkersSection,
)
from cluster.ray_runtime import connect
from worker.actor import SWITCH_INTERVAL_S
from worker.engine import Engine, EngineConfig
from worker.loader import load_model
from worker.request import GenerateRequest, RequestOutput
from worker.sampling_params import SamplingParams
from worker.tiny_model import build_tiny_checkpoint

console = Console(stderr=True)
ENGINE = EngineSection(num_pages=1024, page_size=16, max_running=8, max_model_len=1024)


def prompts(count: int) -> list[str]:
    return [
        f"Request {i}: tell me what the router does with a shared prefix." for i in range(count)
    ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(ttft: list[float], gaps: list[float]) -> dict[str, float]:
    ms = 1000.0
    return {
        "ttft_p50_ms": ms * statistics.median(ttft),
        "ttft_p90_ms": ms * percentile(ttft, 0.9),
        "token_p50_ms": ms * statistics.median(gaps),
        "token_p90_ms": ms * percentile(gaps, 0.9),
    }


def in_process(model_source: str, texts: list[str], tokens: int) -> dict[str, float]:
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as in the worker actor: a fair baseline
    loaded = load_model(model_source)
    config = EngineConfig(**{**asdict(ENGINE), "model_revision": loaded.revision})
    engine = Engine(loaded.model, loaded.tokenizer, config)
    engine.start()
    ttft, gaps = [], []
    sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    try:
        for i, text in enumerate(
            track(texts, "in-process engine", console=console, transient=True)
        ):
            outputs: queue.SimpleQueue[tuple[float, RequestOutput]] = queue.SimpleQueue()
            began = time.perf_counter()
            engine.submit(
                GenerateRequest(f"p{i}", prompt=text, sampling=sampling),
                lambda o, sink=outputs: sink.put((time.perf_counter(), o)),
            )
            stamps = []
            while True:
                stamp, output = outputs.get()
                stamps.append(stamp)
                if output.finished:
                    break
            ttft.append(stamps[0] - began)
            gaps.extend(b - a for a, b in itertools.pairwise(stamps))
    finally:
        engine.stop()
    return summary(ttft, gaps)


def through_ray(model_source: str, texts: list[str], tokens: int) -> dict[str, float]:
    import ray

    from cluster.serve import place_router, place_workers

    config = ClusterConfig(
        model=ModelSection(source=model_source, device="cpu"),
        engine=ENGINE,
        workers=WorkersSection(count=1),
        router=RouterSection(port=0),
        metrics=MetricsSection(enabled=False),
    )
    started = connect()
    try:
        workers = place_workers(config)
        router = place_router(config, workers)
        client = Client(ray.get(router.endpoint.remote()))
        list(client.generate(text_request("warm up", max_tokens=2)))
        ttft, gaps = [], []
        for text in track(texts, "Ray + gRPC", console=console, transient=True):
            request = text_request(text, max_tokens=tokens)
            request.sampling.ignore_eos = True
            began = time.perf_counter()
            stamps = [time.perf_counter() for _ in client.generate(request)]
            ttft.append(stamps[0] - began)
            gaps.extend(b - a for a, b in itertools.pairwise(stamps))
        for handle in [router, *workers.values()]:
            ray.kill(handle, no_restart=True)
        return summary(ttft, gaps)
    finally:
        if started:
            ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--model", default="tiny", help="'tiny', 'default' (SmolLM2) or a path")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    source = args.model
    if source == "tiny":
        source = str(build_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="radixmesh-tiny-"))))
    texts = prompts(args.requests)
    engine = in_process(source, texts, args.tokens)
    served = through_ray(source, texts, args.tokens)
    overhead = {key: served[key] - engine[key] for key in engine}
    result = {
        "model": args.model,
        "requests": args.requests,
        "tokens": args.tokens,
        "in_process": engine,
        "ray_grpc": served,
        "overhead": overhead,
    }
    print(json.dumps(result))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2))
    table = Table(
        title=f"serving overhead ({args.model}, {args.requests} requests x {args.tokens} tokens)"
    )
    for column in ("", "TTFT p50 ms", "TTFT p90 ms", "per token p50 ms", "per token p90 ms"):
        table.add_column(column, justify="right")
    for name, row in (
        ("in-process engine", engine),
        ("Ray + gRPC", served),
        ("overhead", overhead),
    ):
        table.add_row(
            name,
            *(
                f"{row[k]:.2f}"
                for k in ("ttft_p50_ms", "ttft_p90_ms", "token_p50_ms", "token_p90_ms")
            ),
        )
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
