"""The chart's Grafana dashboard (helm/radixmesh/files/grafana-dashboard.json) reads only series a
running cluster exposes, and reads them as their types allow: counters and histograms through
rate() or increase(), gauges as they are; each panel on the datasource the dashboard asks for."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from cluster.client import Client, text_request
from cluster.router_metrics import RouterCollector
from tests.cluster.local_cluster import SERVED_NAME, start_cluster
from tests.helm.chart import CHART
from worker.loader import LoadedModel
from worker.metrics import EngineCollector

DASHBOARD = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
SERIES = re.compile(r"(\w*)\(?(radixmesh_\w+)")
CUMULATIVE = ("_total", "_bucket", "_sum", "_count")


def panels() -> Iterator[dict[str, Any]]:
    return (p for p in DASHBOARD["panels"] if p["type"] != "row")


def expressions() -> Iterator[str]:
    for panel in panels():
        for target in panel["targets"]:
            yield target["expr"]


def exposed(*collectors: Collector) -> set[str]:
    """Every sample name the collectors write (`_total`, `_bucket`... included)."""
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    text = generate_latest(registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}


@pytest.fixture(scope="module")
def series(tiny: LoadedModel) -> set[str]:
    """What a router and its worker expose once they have served a generation over gRPC and an
    embedding over HTTP."""
    cluster = start_cluster(tiny, workers=1, http=True)
    try:
        client = Client(cluster.target)
        list(client.generate(text_request("Dashboards read this.", max_tokens=3), timeout=60))
        client.close()
        with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="-", max_retries=0) as sdk:
            sdk.embeddings.create(model=SERVED_NAME, input="and this")
        ((name, engine),) = cluster.engines.items()
        return exposed(RouterCollector(cluster.service), EngineCollector(engine, name))
    finally:
        cluster.close()


def test_every_series_the_dashboard_reads_is_exposed(series: set[str]) -> None:
    read = {name for expr in expressions() for _, name in SERIES.findall(expr)}
    assert len(read) > 20
    assert read - series == set()


def test_counters_and_histograms_are_read_as_rates_and_gauges_as_they_are(
    series: set[str],
) -> None:
    for expr in expressions():
        for function, name in SERIES.findall(expr):
            cumulative = name.endswith(CUMULATIVE)
            assert (function in ("rate", "increase")) == cumulative, (name, expr)


def test_every_panel_asks_the_datasource_variable_and_has_a_unit() -> None:
    (variable,) = DASHBOARD["templating"]["list"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels():
        assert panel["datasource"]["uid"] == "${" + variable["name"] + "}", panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        assert panel["targets"] and panel["description"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_no_two_panels_share_a_cell_of_the_grid() -> None:
    """Grafana pushes an overlapping panel down, out of the row it was put in (the router's
    prediction once overlapped the workers' row)."""
    taken: dict[tuple[int, int], str] = {}
    for panel in DASHBOARD["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, (panel["title"], taken[(x, y)])
                taken[(x, y)] = panel["title"]
