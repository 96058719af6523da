"""The router's latency histograms: each call as its client saw it, whichever workers served it.

A call is timed from the moment the router takes it (before its prompt is tokenised) through
every message it forwards, so a retry or a migration to another worker is inside the figures,
as it is inside the client's wait:

- time to first token: to the first message carrying a token (generations);
- inter-token latency: between two messages of one sample carrying tokens (a worker streams
  each token in a message of its own, a speculative step's kept drafts too);
- end to end: to the last message, for calls that ended well: every sample's last message
  reached the router, none ended by an error or an abort (generations, and embeddings apart);
- per call that ended well: its prompt's tokens, the share of them served from cache (the
  number radixmesh is for), and the tokens generated.

A call is counted once by `radixmesh_router_requests{status}`: OK when it ended well; a
refusal or a failure under its gRPC status; a call whose worker ended a sample with an error
`INTERNAL`, with an abort `CANCELLED`. Only those that ended well are timed to their end. The
worker's side (queue, prefill, decode, steps) is worker/latency_metrics.py.
"""

from __future__ import annotations

import time

from prometheus_client import Histogram

from protos.radixmesh.v1 import serving_pb2
from worker.latency_metrics import (
    LATENCY_BUCKETS,
    RATIO_BUCKETS,
    STEP_BUCKETS,
    TOKEN_BUCKETS,
    histogram,
)
from worker.request import FINISH_ABORT, FINISH_ERROR


class RouterLatencies:
    def __init__(self) -> None:
        self.first_token = histogram(
            "radixmesh_router_time_to_first_token_seconds",
            "Seconds from the router taking a generation to its first token",
            LATENCY_BUCKETS,
        )
        self.inter_token = histogram(
            "radixmesh_router_inter_token_latency_seconds",
            "Seconds between two tokens of one sample, as forwarded",
            STEP_BUCKETS,
        )
        self.end_to_end = histogram(
            "radixmesh_router_e2e_request_latency_seconds",
            "Seconds from the router taking a generation to its last message (calls that ended "
            "well)",
            LATENCY_BUCKETS,
        )
        self.embedding = histogram(
            "radixmesh_router_embedding_latency_seconds",
            "Seconds from the router taking an embedding request to its embedding",
            LATENCY_BUCKETS,
        )
        self.prompt_tokens = histogram(
            "radixmesh_router_request_prompt_tokens",
            "Prompt tokens of each call that ended well",
            TOKEN_BUCKETS,
        )
        self.cached_share = histogram(
            "radixmesh_router_request_cached_prompt_ratio",
            "Share of each call's prompt tokens served from cache (calls that ended well)",
            RATIO_BUCKETS,
        )
        self.generated_tokens = histogram(
            "radixmesh_router_request_generation_tokens",
            "Tokens generated for each generation that ended well, all its samples",
            TOKEN_BUCKETS,
        )

    def histograms(self) -> tuple[Histogram, ...]:
        return (
            self.first_token,
            self.inter_token,
            self.end_to_end,
            self.embedding,
            self.prompt_tokens,
            self.cached_share,
            self.generated_tokens,
        )

    def call(self, embedding: bool) -> CallClock:
        """Start timing a call the router has just taken."""
        return CallClock(self, embedding)


class CallClock:
    """One call's stopwatch: `forwarded` for each message on its way to the client, `ended` once
    the call ended well (its `outcome`). Only reads a clock and observes: never fails the
    call."""

    def __init__(self, latencies: RouterLatencies, embedding: bool) -> None:
        self._latencies = latencies
        self._embedding = embedding
        self._began = time.perf_counter()
        self._first: float | None = None
        self._last: dict[int, float] = {}
        """Sample index -> when its latest message with tokens went out."""
        self._latest = self._began
        """When the latest message went out."""
        self._reasons: set[str] = set()
        """The finish reasons of the samples that ended."""
        self._generated = 0
        self._prompt: tuple[int, int] | None = None
        """The prompt's tokens and those cached, as the first message said (a worker that
        resumes the call after a failure reports its own hit: not the client's)."""

    @property
    def latest(self) -> float:
        """When the latest message went out (time.perf_counter)."""
        return self._latest

    def forwarded(self, response: serving_pb2.GenerateResponse) -> None:
        now = self._latest = time.perf_counter()
        if self._prompt is None:
            self._prompt = (response.prompt_tokens, response.cached_prompt_tokens)
        if response.finished:
            self._reasons.add(response.finish_reason)
        tokens = len(response.token_ids)
        if not tokens:
            return
        self._generated += tokens
        if self._first is None:
            self._first = now
            self._latencies.first_token.observe(now - self._began)
        last = self._last.get(response.index)
        if last is not None:
            self._latencies.inter_token.observe(now - last)
        self._last[response.index] = now

    def outcome(self) -> str:
        """How the call ended once every sample has: the status it is counted under (a worker
        that failed a sample ends it with an error; an Abort, or a stopping engine, with
        `abort`)."""
        if FINISH_ERROR in self._reasons:
            return "INTERNAL"
        return "CANCELLED" if FINISH_ABORT in self._reasons else "OK"

    def usage(self) -> tuple[int, int, int] | None:
        """The prompt's tokens, those cached (as the first message said) and the tokens
        forwarded so far; None before the first message."""
        if self._prompt is None:
            return None
        return (*self._prompt, self._generated)

    def ended(self) -> None:
        """The call ended well, at its latest message."""
        latencies = self._latencies
        seconds = self._latest - self._began
        (latencies.embedding if self._embedding else latencies.end_to_end).observe(seconds)
        prompt, cached = self._prompt or (0, 0)
        latencies.prompt_tokens.observe(prompt)
        if prompt:
            latencies.cached_share.observe(cached / prompt)
        if not self._embedding:
            latencies.generated_tokens.observe(self._generated)
