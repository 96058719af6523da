"""Prometheus metrics of one worker, read from the engine's counters at scrape time, and its
latency histograms (worker/latency_metrics.py).

Nothing is counted twice: the engine keeps its counters and histograms, this collector only
exposes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from worker.latency_metrics import labelled

if TYPE_CHECKING:  # the router process serves its metrics with this module and has no torch
    from worker.engine import Engine


class EngineCollector(Collector):
    def __init__(self, engine: Engine, worker: str) -> None:
        self.engine = engine
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        labels = ["worker"]
        counters = {
            "radixmesh_worker_requests_finished": ("Requests finished", stats.requests_finished),
            "radixmesh_worker_prompt_tokens": (
                "Prompt tokens of finished requests",
                stats.prompt_tokens,
            ),
            "radixmesh_worker_cached_prompt_tokens": (
                "Prompt tokens served from the prefix cache",
                stats.cached_prompt_tokens,
            ),
            "radixmesh_worker_generated_tokens": ("Tokens generated", stats.generated_tokens),
            "radixmesh_worker_evicted_pages": (
                "KV pages evicted from the cache",
                stats.evicted_pages,
            ),
            "radixmesh_worker_preemptions": ("Sequences preempted for pages", stats.preemptions),
            "radixmesh_worker_draft_tokens": (
                "Draft tokens verified by speculative decoding",
                stats.draft_tokens,
            ),
            "radixmesh_worker_accepted_draft_tokens": (
                "Draft tokens the sample drew too (each saved a decoding step)",
                stats.accepted_draft_tokens,
            ),
            "radixmesh_worker_prediction_draft_tokens": (
                "Of the draft tokens verified, those from a request's predicted output",
                stats.prediction_draft_tokens,
            ),
            "radixmesh_worker_accepted_prediction_draft_tokens": (
                "Of those, the ones the sample drew too",
                stats.accepted_prediction_draft_tokens,
            ),
            "radixmesh_worker_demoted_pages": (
                "KV pages copied from the device to the host tier on eviction",
                stats.demoted_pages,
            ),
            "radixmesh_worker_promoted_pages": (
                "KV pages copied from the host tier back to the device for a match",
                stats.promoted_pages,
            ),
            "radixmesh_worker_host_evicted_pages": (
                "KV pages dropped from the host tier",
                stats.host_evicted_pages,
            ),
            "radixmesh_worker_host_hit_tokens": (
                "Prompt tokens served from pages promoted from the host tier",
                stats.host_hit_tokens,
            ),
            "radixmesh_worker_disk_hit_tokens": (
                "Prompt positions read back from the saved cache on disk",
                stats.disk_hit_tokens,
            ),
            "radixmesh_worker_disk_skipped_tokens": (
                "Prompt positions on disk recomputed instead: recomputing was priced faster",
                stats.disk_skipped_tokens,
            ),
            "radixmesh_worker_peer_read_tokens": (
                "Prompt positions read from another worker's cache instead of recomputed",
                stats.peer_read_tokens,
            ),
            "radixmesh_worker_peer_read_failures": (
                "Reads from another worker's cache that failed or brought less than asked",
                stats.peer_read_failures,
            ),
            "radixmesh_worker_peer_skipped_tokens": (
                "Prompt positions another worker held, recomputed: that was priced faster",
                stats.peer_skipped_tokens,
            ),
            "radixmesh_worker_disk_spilled_pages": (
                "Pages eviction dropped from the last tier that were written to disk",
                stats.disk_spilled_pages,
            ),
            "radixmesh_worker_disk_spill_skipped_pages": (
                "Pages eviction dropped that were not written to disk: the queue was full",
                stats.disk_spill_skipped_pages,
            ),
            "radixmesh_worker_adapter_swaps": (
                "LoRA adapters copied into a device slot",
                stats.adapter_swaps,
            ),
            "radixmesh_worker_adapter_swap_seconds": (
                "Seconds spent copying LoRA adapters into device slots",
                stats.adapter_swap_seconds_total,
            ),
            "radixmesh_worker_encoder_runs": (
                "Images the vision encoder encoded",
                stats.encoder_runs,
            ),
            "radixmesh_worker_encoder_cache_hits": (
                "Images whose vision encoder output came from the encoder cache",
                stats.encoder_cache_hits,
            ),
            "radixmesh_worker_encoder_seconds": (
                "Seconds spent in the vision encoder",
                stats.encoder_seconds,
            ),
        }
        for name, (text, value) in counters.items():
            family = CounterMetricFamily(name, text, labels=labels)
            family.add_metric([self.worker], value)
            yield family
        gauges = {
            "radixmesh_worker_running": ("Sequences running", stats.running),
            "radixmesh_worker_waiting": ("Sequences waiting (queue depth)", stats.waiting),
            "radixmesh_worker_pages_free": ("KV pages free", stats.free_pages),
            "radixmesh_worker_kv_pool_bytes": (
                "Bytes of the device KV pool (sized at start: engine.num_pages, "
                "kv_cache_memory_bytes or gpu_memory_utilization)",
                self.engine.pool.bytes,
            ),
            "radixmesh_worker_pages_cached": (
                "KV pages owned by the prefix cache",
                stats.cached_pages,
            ),
            "radixmesh_worker_pages_private": (
                "KV pages private to running sequences",
                stats.private_pages,
            ),
            "radixmesh_worker_host_pages": ("Pages of the host tier", stats.host_total_pages),
            "radixmesh_worker_host_pages_cached": (
                "Host-tier pages holding cached KV",
                stats.host_cached_pages,
            ),
            "radixmesh_worker_adapters_loaded": (
                "LoRA adapters held (host memory and device slots)",
                stats.adapters_loaded,
            ),
            "radixmesh_worker_adapters_resident": (
                "LoRA adapters in a device slot",
                stats.adapters_resident,
            ),
            "radixmesh_worker_adapter_swap_seconds_avg": (
                "Recent time to copy one LoRA adapter into a slot (EWMA, seconds)",
                stats.adapter_swap_seconds,
            ),
            "radixmesh_worker_disk_bytes": (
                "Bytes of KV the saved cache holds on disk",
                stats.disk_bytes,
            ),
            "radixmesh_worker_disk_bytes_bound": (
                "The most the saved cache may hold: persist_max_bytes, lowered if the disk filled",
                stats.disk_bytes_bound,
            ),
        }
        for name, (text, value) in gauges.items():
            gauge = GaugeMetricFamily(name, text, labels=labels)
            gauge.add_metric([self.worker], value)
            yield gauge
        yield from labelled(self.engine.latencies.histograms(), "worker", self.worker)


def serve_metrics(collector: Collector, host: str, port: int) -> int:
    """Serve `collector` on http://host:port/metrics; returns the bound port (port 0: any free)."""
    registry = CollectorRegistry()
    registry.register(collector)
    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
