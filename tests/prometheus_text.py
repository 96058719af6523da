"""Histograms read back from Prometheus' text format, as a scraper reads them: the load test's
own reader (cluster/loadtest/server_metrics.py), with what a test checks beside it."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from cluster.loadtest.server_metrics import Buckets, parse


def exposed(collector: Collector) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def histograms(collector: Collector) -> dict[str, Buckets]:
    """Every histogram `collector` exposes, by family name, through the text format; each one's
    +Inf bucket holds every observation."""
    out = parse(exposed(collector))
    for name, h in out.items():
        assert h.cumulative[math.inf] == h.count, name
    return out


def series_labels(collector: Collector) -> dict[str, list[dict[str, str]]]:
    """Each histogram's series, by their labels besides `le`."""
    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(exposed(collector)):
        if family.type == "histogram":
            series = {
                tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                for s in family.samples
            }
            out[family.name] = [dict(labels) for labels in sorted(series)]
    return out


def at_most(h: Buckets, bound: float) -> float:
    """Observations at or below the smallest bucket bound >= `bound`."""
    return h.cumulative[min(le for le in h.cumulative if le >= bound)]
