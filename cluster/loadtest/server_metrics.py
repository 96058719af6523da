"""What the cluster measured of a run, beside what the client measured: `--server-metrics`.

The command scrapes the Prometheus endpoints it is given (the router's, and any workers') just
before a run and just after it, subtracts, and reads percentiles from the latency histograms'
buckets as Prometheus' `histogram_quantile` does (linear within the bucket the rank falls in).
The router's histograms (cluster/request_latency.py) time each call from the moment the router
takes it; the client's figures add what lies outside: the network, the HTTP or gRPC layers on
both sides. The workers' split a first token into queue and prefill.

A bucketed percentile is only as fine as the buckets: between two bounds it is interpolated.
Other traffic to the cluster during the run is in the server's figures and not in the client's.
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from cluster.loadtest.control import ServerError

SCRAPE_TIMEOUT_S = 10.0

SERVER_ROWS = (
    ("TTFT", "radixmesh_router_time_to_first_token_seconds"),
    ("inter-token", "radixmesh_router_inter_token_latency_seconds"),
    ("latency", "radixmesh_router_e2e_request_latency_seconds"),
    ("worker queue", "radixmesh_worker_request_queue_seconds"),
    ("worker prefill", "radixmesh_worker_request_prefill_seconds"),
    ("worker TTFT", "radixmesh_worker_time_to_first_token_seconds"),
)
"""The report's rows: a name, and the histogram it is read from (all series of it summed)."""


@dataclass
class Buckets:
    """One histogram, every series of it summed (Prometheus' `sum by (le)`)."""

    count: float = 0.0
    sum: float = 0.0
    cumulative: dict[float, float] = field(default_factory=dict)
    """Upper bound -> observations at or below it."""

    def minus(self, before: Buckets) -> Buckets:
        return Buckets(
            self.count - before.count,
            self.sum - before.sum,
            {le: n - before.cumulative.get(le, 0.0) for le, n in self.cumulative.items()},
        )

    def plus(self, other: Buckets) -> Buckets:
        bounds = self.cumulative.keys() | other.cumulative.keys()
        return Buckets(
            self.count + other.count,
            self.sum + other.sum,
            {le: self.cumulative.get(le, 0.0) + other.cumulative.get(le, 0.0) for le in bounds},
        )

    def quantile(self, q: float) -> float | None:
        """`histogram_quantile(q, ...)`: None with no observation; the highest finite bound when
        the rank falls in the +Inf bucket."""
        bounds = sorted(self.cumulative)
        total = self.cumulative.get(math.inf, self.count)
        if total <= 0 or not bounds:
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for le in bounds:
            at = self.cumulative[le]
            if at >= rank:
                if math.isinf(le):
                    return lower
                if at == below:
                    return le
                return lower + (le - lower) * (rank - below) / (at - below)
            lower, below = le, at
        return lower


def parse(text: str) -> dict[str, Buckets]:
    """Every histogram in a Prometheus text page, by family name, its series summed."""
    out: dict[str, Buckets] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        h = out.setdefault(family.name, Buckets())
        for sample in family.samples:
            if sample.name.endswith("_count"):
                h.count += sample.value
            elif sample.name.endswith("_sum"):
                h.sum += sample.value
            elif sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                h.cumulative[le] = h.cumulative.get(le, 0.0) + sample.value
    return out


Scrape = list[dict[str, Buckets]]
"""Each endpoint's histograms, in the order given."""


def scrape(urls: Iterable[str]) -> Scrape:
    """Every endpoint's histograms. ServerError naming the endpoint that cannot be read."""
    pages = []
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as answer:
                pages.append(parse(answer.read().decode()))
        except (OSError, ValueError) as err:
            raise ServerError(f"--server-metrics: cannot read {url}: {err}") from err
    return pages


def summary(before: Scrape, after: Scrape) -> dict[str, object]:
    """The run's server-side figures: per row, observations and p50 / p90 / p99 in ms (None
    where nothing was observed), the endpoints' differences summed. A row is left out where no
    endpoint exposes its histogram, and says `reset` where one endpoint's went down (its process
    restarted during the run: its buckets started over)."""
    rows: dict[str, object] = {}
    for label, name in SERVER_ROWS:
        if not any(name in page for page in after):
            continue
        run, reset = Buckets(), False
        for old, new in zip(before, after, strict=True):
            if name not in new:
                continue
            part = new[name].minus(old.get(name, Buckets()))
            reset |= part.count < 0 or any(n < 0 for n in part.cumulative.values())
            run = run.plus(part)
        if reset:
            rows[label] = {"reset": True}
            continue
        rows[label] = {"observations": int(run.count)} | {
            f"p{int(q * 100)}": _ms(run.quantile(q)) for q in (0.5, 0.9, 0.99)
        }
    return rows


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


def markdown(labels: Sequence[str], summaries: Sequence[dict[str, object]]) -> str:
    """A table per run side by side: each row's p50 / p90 / p99 ms and its observations."""
    names = [label for label, _ in SERVER_ROWS if any(label in s for s in summaries)]
    if not names:
        return ""
    lines = [
        "As the cluster measured it (--server-metrics; bucketed, ms):",
        "",
        "| metric | " + " | ".join(labels) + " |",
        "|" + " --- |" * (len(labels) + 1),
    ]
    for name in names:
        cells = []
        for s in summaries:
            row = s.get(name)
            if not isinstance(row, dict):
                cells.append("-")
            elif row.get("reset"):
                cells.append("restarted")
            else:
                p = [row.get(k) for k in ("p50", "p90", "p99")]
                shown = " / ".join("-" if v is None else f"{v:.1f}" for v in p)
                cells.append(f"{shown} ({row['observations']})")
        lines.append(f"| {name} p50 / p90 / p99 (n) | " + " | ".join(cells) + " |")
    return "\n".join(lines)
