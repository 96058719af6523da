"""One worker as a Ray actor: the model, its engine thread and its grpc.aio server.

A plain class; the cluster wraps it with `ray.remote` (one GPU, or CPUs) and restarts it when
it dies. It binds its gRPC server to `host` on a free port and its metrics to `metrics_port` on
`metrics_host` (config metrics.host; default: `host`), and tells whoever asks where they are.
`drain` stops taking requests (health NOT_SERVING), lets the running ones finish (or aborts
them at the deadline) and stops.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import torch

from protos.radixmesh.v1 import worker_pb2_grpc
from worker.engine import Engine, EngineConfig
from worker.event_loop import EventLoopThread
from worker.grpc_server import GrpcServer, ServerLimits, internal_message_bytes, start_server
from worker.loader import load_model
from worker.metrics import EngineCollector, serve_metrics
from worker.servicer import WorkerServicer
from worker.weight_formats import check_weight_format

log = logging.getLogger(__name__)
SWITCH_INTERVAL_S = 0.0005
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def advertised_host(host: str) -> str:
    """The address others reach a server bound to `host` at: a wildcard bind (0.0.0.0, ::) is
    reached at this node's IP, as Ray knows it (in Kubernetes, the pod IP)."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    import ray  # noqa: PLC0415 - only a wildcard bind inside a Ray actor needs it

    return str(ray.util.get_node_ip_address())


class WorkerActor:
    def __init__(
        self,
        name: str,
        model_source: str,
        engine: dict[str, Any],
        device: str = "cpu",
        dtype: str | None = None,
        host: str = "127.0.0.1",
        metrics_port: int | None = None,
        threads: int | None = None,
        weights: str = "float32",
        metrics_host: str | None = None,
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        # The engine thread runs Python almost without pause; each output must then reach the
        # gRPC loop thread. CPython hands the GIL over every 5 ms by default: every streamed token
        # could wait that long. 0.5 ms keeps the handover well under a token's time.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.name = name
        if dtype is None and device == "cuda":
            dtype = "bfloat16"
        fmt = check_weight_format(weights, "model.weights")
        loaded = load_model(model_source, DTYPES[dtype] if dtype else None, device, fmt)
        self.checkpoint = loaded.path
        config = EngineConfig(**{**engine, "model_revision": loaded.revision})
        self.engine = Engine(
            loaded.model, loaded.tokenizer, config, source=name, vision=loaded.vision
        )
        self.engine.start()
        self.loop = EventLoopThread(f"grpc-{name}")
        servicer = WorkerServicer(self.engine, name, loaded.path)
        register = [(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "radixmesh.v1.Worker")]
        limits = ServerLimits(internal_message_bytes(config.max_images, config.max_image_bytes))
        self.server: GrpcServer = self.loop.run(start_server(register, host, 0, limits))
        self.host = advertised_host(host)
        self.metrics_port = None
        if metrics_port is not None:
            self.metrics_port = serve_metrics(
                EngineCollector(self.engine, name), metrics_host or host, metrics_port
            )
        log.info(
            "worker %s serving %s (weights %s) on %s (pid %d)",
            name,
            loaded.path.name,
            fmt,
            self.address(),
            os.getpid(),
        )

    def address(self) -> str:
        return f"{self.host}:{self.server.port}"

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "address": self.address(),
            "metrics_port": self.metrics_port,
            "pid": os.getpid(),
            "checkpoint": str(self.checkpoint),
            "kv_pages": self.engine.pool.pages,
            "page_size": self.engine.config.page_size,
            "kv_bytes": self.engine.pool.bytes,
            "kv_sized_by": self.engine.pool.reason,
        }

    def drain(self, timeout: float) -> bool:
        """Stop taking requests, wait up to `timeout` for running ones, stop; True if all ended."""
        self.loop.run(self.server.set_serving(False))
        deadline = time.monotonic() + timeout
        while (busy := self.engine.scheduler.has_work()) and time.monotonic() < deadline:
            time.sleep(0.05)
        idle = not busy
        self.loop.run(self.server.stop(grace=1.0))
        self.engine.stop()
        self.loop.stop()
        return idle
