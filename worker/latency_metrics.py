"""Latency histograms: where a request's time went, as Prometheus reads it.

The counters of worker/metrics.py say how much was done; these say how long it took, which is
what an operator's dashboards and alerts are made of (time to first token above all). One
prometheus_client `Histogram` each, kept out of any registry: the worker's and the router's
collectors hand them out at scrape time beside their counters.

On a worker (`EngineLatencies`), each observed once per request, at the moment it happens:

    submitted --queue--> admitted --prefill--> first output --decode--> finished
    |------------- time to first token ---------|
    |----------------------------- end to end ------------------------------|

queue and prefill for every request (an embedding's prefill is its whole computation); time to
first token, decode and end to end for generations a client asked for from their start (not a
sample resumed after its worker failed: the router's histograms hold what its client saw), the
last two only when it ended by a stop or its length. A request refused, aborted or failed is
timed up to its first output if it had one, and never to its end (the counters count it).
Each engine step adds its tokens and its seconds.

The router's side is cluster/request_latency.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from prometheus_client import Histogram
from prometheus_client.metrics_core import Metric

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
"""Seconds a request waits or runs: from a GPU's few milliseconds to a CPU's minutes, tens of
milliseconds apart where a GPU's first tokens fall."""

STEP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Seconds of one engine step, or between two tokens of one sample."""

TOKEN_BUCKETS = (
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000,
    200_000, 500_000, 1_000_000,
)  # fmt: skip
"""Token counts (1-2-5 steps, as vLLM's)."""

RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
"""Fractions; `le="0.0"` counts the requests that reused nothing."""


def histogram(name: str, documentation: str, buckets: Iterable[float]) -> Histogram:
    """A histogram outside every registry (its owner's collector yields it)."""
    return Histogram(name, documentation, buckets=tuple(buckets), registry=None)


def labelled(histograms: Iterable[Histogram], label: str, value: str) -> Iterator[Metric]:
    """The histograms' metric families with `label="value"` on every sample."""
    for each in histograms:
        for metric in each.collect():
            out = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            out.samples = [s._replace(labels={label: value, **s.labels}) for s in metric.samples]
            yield out


class EngineLatencies:
    """One engine's histograms. `first_output`, `finished` and `step` run on the engine thread;
    a scrape reads them from another (each histogram locks its own values)."""

    def __init__(self) -> None:
        self.queue = histogram(
            "radixmesh_worker_request_queue_seconds",
            "Seconds from a request's arrival at the worker to its admission",
            LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "radixmesh_worker_request_prefill_seconds",
            "Seconds from a request's admission to its first output (its prompt computed)",
            LATENCY_BUCKETS,
        )
        self.first_token = histogram(
            "radixmesh_worker_time_to_first_token_seconds",
            "Seconds from a generation's arrival at the worker to its first token",
            LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "radixmesh_worker_request_decode_seconds",
            "Seconds from a generation's first token to its last (ended by a stop or its length)",
            LATENCY_BUCKETS,
        )
        self.end_to_end = histogram(
            "radixmesh_worker_e2e_request_latency_seconds",
            "Seconds from a generation's arrival at the worker to its end (a stop or its length)",
            LATENCY_BUCKETS,
        )
        self.step_tokens = histogram(
            "radixmesh_worker_step_tokens", "Tokens computed by one engine step", TOKEN_BUCKETS
        )
        self.step_seconds = histogram(
            "radixmesh_worker_step_seconds",
            "Seconds of one engine step's forward pass and sampling",
            STEP_BUCKETS,
        )

    def histograms(self) -> tuple[Histogram, ...]:
        return (
            self.queue,
            self.prefill,
            self.first_token,
            self.decode,
            self.end_to_end,
            self.step_tokens,
            self.step_seconds,
        )

    def first_output(
        self, submitted: float, admitted: float, generation: bool, now: float | None = None
    ) -> float:
        """A request's first output (a token, or an embedding): its queue and prefill times, and
        for a generation its time to first token. Returns `now`."""
        now = time.perf_counter() if now is None else now
        self.queue.observe(admitted - submitted)
        self.prefill.observe(now - admitted)
        if generation:
            self.first_token.observe(now - submitted)
        return now

    def finished(self, submitted: float, first_output: float, now: float | None = None) -> None:
        """A generation ended by a stop or its length."""
        now = time.perf_counter() if now is None else now
        self.decode.observe(now - first_output)
        self.end_to_end.observe(now - submitted)

    def step(self, tokens: int, seconds: float) -> None:
        self.step_tokens.observe(tokens)
        self.step_seconds.observe(seconds)
