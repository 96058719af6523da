"""Prometheus metrics of the router, read from the service's counters at scrape time, and its
latency histograms (cluster/request_latency.py)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from cache.text_index import TextIndexStats
from cluster.router_service import RouterService
from cluster.text_prompts import TextIndexCounters


class RouterCollector(Collector):
    def __init__(self, service: RouterService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        c = self.service.counters
        counters = {
            "radixmesh_router_routing_decisions": ("Routing decisions made", c.routed),
            "radixmesh_router_retries": (
                "Times a request went to another worker, its own failing before the first token",
                c.retried,
            ),
            "radixmesh_router_migrations": (
                "Times a request was resumed on another worker after its own failed mid-stream",
                c.migrated,
            ),
            "radixmesh_router_predicted_cached_tokens": (
                "Prompt tokens the policy expected workers to serve from cache",
                c.predicted_cached_tokens,
            ),
            "radixmesh_router_cached_tokens": (
                "Prompt tokens workers served from cache",
                c.actual_cached_tokens,
            ),
            "radixmesh_router_decision_seconds": (
                "Time spent choosing workers",
                c.decision_seconds,
            ),
        }
        for name, (text, value) in counters.items():
            family = CounterMetricFamily(name, text)
            family.add_metric([], value)
            yield family
        requests = CounterMetricFamily(
            "radixmesh_router_requests", "Generate calls by final status", labels=["status"]
        )
        for status, count in sorted(c.by_status.items()):
            requests.add_metric([status], count)
        yield requests
        http = CounterMetricFamily(
            "radixmesh_router_http_responses",
            "HTTP API answers by route and status",
            labels=["route", "status"],
        )
        for (route, code), count in sorted(c.http_responses.items()):
            http.add_metric([route, str(code)], count)
        yield http
        rates = self.service.timing.model.rates()
        gauges = {
            "radixmesh_router_in_flight": ("Generate calls in flight", len(self.service.in_flight)),
            "radixmesh_router_healthy_workers": (
                "Workers routed to",
                len(self.service.links.links),
            ),
            "radixmesh_router_index_bytes": (
                "Memory of the per-worker block indexes",
                self.service.links.policy.index_bytes(),
            ),
            "radixmesh_router_learned_prefill_tokens_per_second": (
                "Prefill rate the router has learned from first-token times",
                rates.prefill_rate,
            ),
            "radixmesh_router_learned_decode_seconds_per_running": (
                "Seconds each running request adds to a new first token, learned from streams",
                rates.decode_s,
            ),
            "radixmesh_router_learned_host_tokens_per_second": (
                "Tokens per second workers copy back from their host tier, as learned",
                rates.host_rate or 0.0,
            ),
            "radixmesh_router_learned_disk_tokens_per_second": (
                "Tokens per second workers read back from their saved caches, as learned",
                rates.disk_rate or 0.0,
            ),
            "radixmesh_router_learned_peer_tokens_per_second": (
                "Tokens per second workers read from other workers' caches, as learned "
                "(0: router.peer_kv_rate is 0 and reads are not priced)",
                rates.peer_rate or 0.0,
            ),
        }
        for name, (text, value) in gauges.items():
            gauge = GaugeMetricFamily(name, text)
            gauge.add_metric([], value)
            yield gauge
        yield from self._text_index()
        yield from self._tenants()
        for histogram in self.service.latencies.histograms():
            yield from histogram.collect()

    def _tenants(self) -> Iterator[CounterMetricFamily]:
        """Each tenant's usage under its name ("": the shared namespace; metrics.max_tenants)."""
        book = self.service.tenants
        rows = list(book.tenants.items())  # one copy: a call may add a tenant while this runs
        families = {
            "requests": "Calls served, by tenant",
            "prompt_tokens": "Prompt tokens of the calls served, by tenant",
            "cached_tokens": "Prompt tokens served from a worker's cache, by tenant",
            "generated_tokens": "Tokens generated for the calls served, by tenant",
        }
        for field, text in families.items():
            family = CounterMetricFamily(
                f"radixmesh_router_tenant_{field}", text, labels=["tenant"]
            )
            for tenant, usage in rows:
                family.add_metric([tenant], getattr(usage, field))
            yield family
        uncounted = CounterMetricFamily(
            "radixmesh_router_uncounted_tenant_requests",
            "Calls served to tenants past metrics.max_tenants (not counted by name)",
        )
        uncounted.add_metric([], book.uncounted_requests)
        yield uncounted

    def _text_index(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        texts = self.service.text_prompts
        t = texts.counters if texts is not None else TextIndexCounters()
        index = texts.index.stats() if texts is not None else TextIndexStats(0, 0, 0, 0)
        counters = {
            "prompts": ("Text prompts tokenised through the text index", t.prompts),
            "prompt_chars": ("Characters of those prompts", t.prompt_chars),
            "reused_chars": ("Characters whose token ids came from the text index", t.reused_chars),
            "reused_tokens": ("Token ids reused from the text index", t.reused_tokens),
            "tokenized_chars": ("Characters tokenised after the text index", t.tokenized_chars),
            "backoff_tokens": (
                "Tokens of matched text tokenised again (exact mode's back-off)",
                t.backoff_tokens,
            ),
            "seconds": ("Time matching, tokenising and inserting text prompts", t.seconds),
            "evicted_chars": ("Characters dropped from the text index (LRU)", index.evicted_chars),
        }
        for name, (text, value) in counters.items():
            family = CounterMetricFamily(f"radixmesh_router_text_index_{name}", text)
            family.add_metric([], value)
            yield family
        outcomes = CounterMetricFamily(
            "radixmesh_router_text_index_matches",
            "Text index matches by outcome",
            labels=["outcome"],
        )
        for outcome, count in sorted(t.outcomes.items()):
            outcomes.add_metric([outcome], count)
        yield outcomes
        gauges = {"chars": ("Characters held", index.chars), "nodes": ("Nodes", index.nodes)}
        for name, (text, value) in gauges.items():
            gauge = GaugeMetricFamily(f"radixmesh_router_text_index_{name}", text)
            gauge.add_metric([], value)
            yield gauge
