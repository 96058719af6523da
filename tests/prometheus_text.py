"""Histograms read back from Prometheus' text format, as a scraper reads them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector


@dataclass
class Histogram:
    count: float = 0.0
    sum: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)
    """Upper bound -> observations at or below it (cumulative, as exposed)."""
    labels: dict[str, str] = field(default_factory=dict)
    """The labels every sample carried besides `le`."""

    def at_most(self, bound: float) -> float:
        """Observations at or below the smallest bucket bound >= `bound`."""
        return self.buckets[min(le for le in self.buckets if le >= bound)]

    def minus(self, before: Histogram) -> Histogram:
        """What was observed since `before` (a scrape of the same histogram)."""
        return Histogram(
            self.count - before.count,
            self.sum - before.sum,
            {le: n - before.buckets.get(le, 0.0) for le, n in self.buckets.items()},
            self.labels,
        )


def histograms(collector: Collector) -> dict[str, Histogram]:
    """Every histogram `collector` exposes, by family name, through the text format."""
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    out: dict[str, Histogram] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        h = out[family.name] = Histogram()
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "le"}
            assert h.labels in ({}, labels), f"{family.name}: one series expected"
            h.labels = labels
            if sample.name.endswith("_count"):
                h.count = sample.value
            elif sample.name.endswith("_sum"):
                h.sum = sample.value
            elif sample.name.endswith("_bucket"):
                h.buckets[float(sample.labels["le"])] = sample.value
        assert h.buckets[math.inf] == h.count, family.name
    return out
