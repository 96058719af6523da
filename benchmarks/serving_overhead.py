"""What the serving path costs: TTFT and per-token time through Ray + gRPC and through the HTTP
API, against the engine itself.

The same kind of requests, one at a time, go (1) to an in-process engine, timed from `submit`
to each output, and (2) through a real Ray cluster, timed at the client: the client -> router
actor -> worker actor over gRPC on loopback, and the client -> the router's OpenAI API (HTTP/1.1,
`/v1/completions`, stream with include_usage) -> the worker over gRPC. Same model, same engine
configuration, a fresh cache each. The gRPC and HTTP requests alternate (which goes first
alternates too), so both see the same machine; their prompts differ (`Request 0`, `Request 1`,
...: even numbers over gRPC, odd over HTTP), so neither finds the other's prompt cached.

    TTFT       gRPC: the first message. HTTP: the response's status line and headers, which the
               router sends once it has the first token (a stream begins only then); the first
               text chunk follows at once unless that token's text is held back (half of a
               multi-byte character: 31 % of the tiny random model's tokens), so the first
               chunk's time is reported apart (`ttft_first_text_*`), not as TTFT.
    per token  each request's (last token - first token) / (tokens - 1), p50 and p90 over the
               requests: HTTP sends no chunk for a held-back token, so gaps between chunks
               would span tokens (`gap_p50_ms`, between messages or chunks, is kept for the
               record).

Reported: p50 / p90 of both per path, and the differences (gRPC over in-process, HTTP over
gRPC). The default model is the built-in tiny one, whose fast forward pass leaves the overhead
visible; `--model default` uses SmolLM2.

Run: `python benchmarks/serving_overhead.py [--requests 40] [--tokens 32] [--model default]`.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

import httpx2
from rich.console import Console
from rich.progress import track
from rich.table import Table

from benchmarks.model_source import model_source
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

console = Console(stderr=True)
ENGINE = EngineSection(num_pages=1024, page_size=16, max_running=8, max_model_len=1024)


def prompts(count: int, start: int = 0, step: int = 1) -> list[str]:
    return [
        f"Request {i}: tell me what the router does with a shared prefix."
        for i in range(start, start + step * count, step)
    ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Timings:
    """One path's requests, as seen by its client (seconds)."""

    ttft: list[float] = field(default_factory=list)
    per_token: list[float] = field(default_factory=list)
    """Per request: (last token - first token) / (tokens - 1)."""
    gaps: list[float] = field(default_factory=list)
    """Between consecutive messages (HTTP: chunks with text)."""
    first_text: list[float] = field(default_factory=list)
    """HTTP: from the send to the first chunk with text."""

    def add(self, began: float, first: float, stamps: list[float], tokens: int) -> None:
        """One request: sent at `began`, first token at `first`, messages at `stamps` (the last
        one carrying the last token), `tokens` tokens in all."""
        self.ttft.append(first - began)
        self.per_token.append((stamps[-1] - first) / max(1, tokens - 1))
        self.gaps.extend(b - a for a, b in itertools.pairwise(stamps))


def summary(timings: Timings) -> dict[str, float]:
    ms = 1000.0
    out = {
        "ttft_p50_ms": ms * statistics.median(timings.ttft),
        "ttft_p90_ms": ms * percentile(timings.ttft, 0.9),
        "token_p50_ms": ms * statistics.median(timings.per_token),
        "token_p90_ms": ms * percentile(timings.per_token, 0.9),
        "gap_p50_ms": ms * statistics.median(timings.gaps) if timings.gaps else 0.0,
    }
    if timings.first_text:
        out["ttft_first_text_p50_ms"] = ms * statistics.median(timings.first_text)
        out["ttft_first_text_p90_ms"] = ms * percentile(timings.first_text, 0.9)
    return out


def in_process(model_source: str, texts: list[str], tokens: int) -> dict[str, float]:
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as in the worker actor: a fair baseline
    loaded = load_model(model_source)
    config = EngineConfig(**{**asdict(ENGINE), "model_revision": loaded.revision})
    engine = Engine(loaded.model, loaded.tokenizer, config, vision=loaded.vision)
    engine.start()
    timings = Timings()
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
            stamps, tokens = [], 0
            while True:
                stamp, output = outputs.get()
                stamps.append(stamp)
                tokens += len(output.token_ids)
                if output.finished:
                    break
            timings.add(began, stamps[0], stamps, tokens)
    finally:
        engine.stop()
    return summary(timings)


def time_grpc(client: Client, text: str, tokens: int, timings: Timings) -> None:
    request = text_request(text, max_tokens=tokens)
    request.sampling.ignore_eos = True
    began = time.perf_counter()
    stamps, count = [], 0
    for message in client.generate(request):
        stamps.append(time.perf_counter())
        count += len(message.token_ids)
    timings.add(began, stamps[0], stamps, count)


def completion_body(model: str, text: str, tokens: int) -> dict[str, object]:
    return {
        "model": model,
        "prompt": text,
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def sse_data(lines: Iterator[str]) -> Iterator[dict]:
    """The JSON of each `data:` event, up to [DONE]."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def time_http(http: httpx2.Client, model: str, text: str, tokens: int, timings: Timings) -> None:
    """One streamed completion; TTFT at the response's start (see the module's docstring)."""
    began = time.perf_counter()
    with http.stream("POST", "/v1/completions", json=completion_body(model, text, tokens)) as r:
        first = time.perf_counter()
        r.raise_for_status()
        stamps, count = [], 0
        for chunk in sse_data(r.iter_lines()):
            stamp = time.perf_counter()
            choice = chunk["choices"][0] if chunk["choices"] else {}
            if choice.get("text") or choice.get("finish_reason"):
                stamps.append(stamp)
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
    timings.first_text.append(stamps[0] - began)
    timings.add(began, first, stamps, count)


def alternating(
    client: Client, http: httpx2.Client, model: str, count: int, tokens: int
) -> tuple[Timings, Timings]:
    """`count` requests over each API, gRPC and HTTP in turn (each first every other time), on
    prompts `Request 0, 2, 4, ...` (gRPC) and `Request 1, 3, 5, ...` (HTTP)."""
    over_grpc, over_http = Timings(), Timings()
    pairs = zip(prompts(count, 0, 2), prompts(count, 1, 2), strict=True)
    for i, (grpc_text, http_text) in enumerate(
        track(list(pairs), "Ray + gRPC / HTTP", console=console, transient=True)
    ):
        grpc_first = i % 2 == 0
        if grpc_first:
            time_grpc(client, grpc_text, tokens, over_grpc)
        time_http(http, model, http_text, tokens, over_http)
        if not grpc_first:
            time_grpc(client, grpc_text, tokens, over_grpc)
    return over_grpc, over_http


def through_ray(model_source: str, count: int, tokens: int) -> tuple[dict[str, float], ...]:
    import ray

    from cluster.serve import place_router, place_workers

    config = ClusterConfig(
        model=ModelSection(source=model_source, device="cpu"),
        engine=ENGINE,
        workers=WorkersSection(count=1),
        router=RouterSection(port=0, http_port=0),
        metrics=MetricsSection(enabled=False),
    )
    started = connect()
    try:
        workers = place_workers(config)
        router = place_router(config, workers)
        client = Client(ray.get(router.endpoint.remote()))
        url = ray.get(router.http_url.remote())
        with httpx2.Client(base_url=url, timeout=60, trust_env=False) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            list(client.generate(text_request("warm up", max_tokens=2)))
            time_http(http, model, "warm up over HTTP", 2, Timings())
            over_grpc, over_http = alternating(client, http, model, count, tokens)
        for handle in [router, *workers.values()]:
            ray.kill(handle, no_restart=True)
        return summary(over_grpc), summary(over_http)
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
    source = model_source(args.model)
    engine = in_process(source, prompts(args.requests, 0, 2), args.tokens)
    served, http = through_ray(source, args.requests, args.tokens)
    grpc_overhead = {key: served[key] - engine[key] for key in engine}
    http_overhead = {key: http[key] - served[key] for key in served}
    result = {
        "model": args.model,
        "requests": args.requests,
        "tokens": args.tokens,
        "in_process": engine,
        "ray_grpc": served,
        "ray_http": http,
        "overhead": grpc_overhead,
        "http_over_grpc": http_overhead,
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
        ("Ray + HTTP (OpenAI API)", http),
        ("gRPC over in-process", grpc_overhead),
        ("HTTP over gRPC", http_overhead),
    ):
        table.add_row(
            name,
            *(
                f"{row[k]:.2f}"
                for k in ("ttft_p50_ms", "ttft_p90_ms", "token_p50_ms", "token_p90_ms")
            ),
        )
    console.print(table)
    console.print(
        f"HTTP's first text chunk: p50 {http['ttft_first_text_p50_ms']:.2f} ms, p90 "
        f"{http['ttft_first_text_p90_ms']:.2f} ms after the send; gaps between messages p50: "
        f"in-process {engine['gap_p50_ms']:.2f}, gRPC {served['gap_p50_ms']:.2f}, HTTP chunks "
        f"{http['gap_p50_ms']:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
