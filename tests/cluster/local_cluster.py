"""A whole cluster in this process: real engines, real gRPC servers on loopback, no Ray.

Workers are engines (each on its own thread) behind the worker gRPC service; the router service
sits behind its own server with the real interceptors and optional TLS. Everything the Ray
actors do, minus process placement; tests that need processes and restarts use Ray itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.config import (
    AdapterSection,
    ClusterConfig,
    EngineSection,
    MetricsSection,
    ModelSection,
    RouterSection,
    SecuritySection,
    engine_options,
)
from cluster.http.server import HttpServer, start_http_server
from cluster.policies import build_policy
from cluster.router_actor import start_router_server
from cluster.router_service import RouterService
from cluster.worker_links import WorkerLinks
from protos.radixmesh.v1 import serving_pb2, serving_pb2_grpc, worker_pb2_grpc
from worker.engine import Engine, EngineConfig
from worker.event_loop import EventLoopThread
from worker.grpc_server import GrpcServer, ServerLimits, internal_message_bytes, start_server
from worker.loader import LoadedModel
from worker.request import GenerateRequest
from worker.servicer import WorkerServicer

SERVED_NAME = "tiny"
ENGINE = EngineSection(num_pages=256, page_size=4, max_running=8, max_model_len=512, max_waiting=64)


@dataclass
class LocalCluster:
    loaded: LoadedModel
    config: ClusterConfig
    loop: EventLoopThread
    links: WorkerLinks
    service: RouterService
    router: GrpcServer
    engines: dict[str, Engine] = field(default_factory=dict)
    workers: dict[str, GrpcServer] = field(default_factory=dict)
    http: HttpServer | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.router.port}"

    @property
    def http_url(self) -> str:
        """The HTTP API's root (start_cluster(http=True))."""
        assert self.http is not None, "started without http=True"
        return f"{self.http.scheme}://127.0.0.1:{self.http.port}"

    def stats(self) -> serving_pb2.GetStatsResponse:
        metadata = []
        if self.config.security.auth_tokens:
            token = next(iter(self.config.security.auth_tokens))
            metadata = [("authorization", f"Bearer {token}")]
        credentials = None
        if self.config.security.tls_cert:
            credentials = grpc.ssl_channel_credentials(
                Path(self.config.security.tls_cert).read_bytes()
            )
        with (
            grpc.secure_channel(self.target, credentials)
            if credentials
            else grpc.insecure_channel(self.target)
        ) as channel:
            stub = serving_pb2_grpc.ServingStub(channel)
            return stub.GetStats(serving_pb2.GetStatsRequest(), metadata=metadata, timeout=10)

    def add_worker(self, name: str) -> None:
        config = EngineConfig(
            **{**engine_options(self.config), "model_revision": self.loaded.revision}
        )
        engine = Engine(
            self.loaded.model, self.loaded.tokenizer, config, source=name, vision=self.loaded.vision
        )
        engine.start()
        servicer = WorkerServicer(engine, name, self.loaded.path)
        register = [(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "radixmesh.v1.Worker")]
        limits = ServerLimits(internal_message_bytes(config.max_images, config.max_image_bytes))
        server = self.loop.run(start_server(register, "127.0.0.1", 0, limits))
        self.engines[name], self.workers[name] = engine, server
        self.loop.run(self.links.attach(name, f"127.0.0.1:{server.port}"))

    def kill_worker(self, name: str) -> None:
        """Stop a worker's server with no grace: what the router sees when its process dies."""
        self.loop.run(self.workers.pop(name).server.stop(0))
        self.engines.pop(name).stop()

    def hold_engines_after(self, steps: int, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
        """Each engine takes `steps` more busy steps, then waits before the next until the
        returned event is set (at most 30 s), except while a request it was given has not
        streamed its first output: a generation cannot end while a test looks at it, however
        slowly the test's thread runs (the engines share its process), and a request sent
        after another one's `steps` is answered all the same."""
        release = threading.Event()
        for engine in self.engines.values():
            original, taken, given = engine.step, [0], list[str]()
            submit, seen = engine.submit, set[str]()

            def submitted(
                request: GenerateRequest, sink: Any, submit: Any = submit, given: list[str] = given
            ) -> int:
                length: int = submit(request, sink)
                given.append(request.request_id)  # queued for the engine thread
                return length

            def answered(
                engine: Engine = engine, given: list[str] = given, seen: set[str] = seen
            ) -> bool:
                """Whether every request the engine was given has streamed something (on the
                engine thread: one still on its way from the inbox has not)."""
                for request_id in list(given):
                    state = engine._requests.get(request_id)
                    if state is not None:
                        seen.add(request_id)
                        if state.first_output_at is None:
                            return False
                    elif request_id not in seen:
                        return False
                return True

            def step(
                original: Callable[[], bool] = original,
                taken: list[int] = taken,
                answered: Callable[[], bool] = answered,
            ) -> bool:
                if taken[0] >= steps:
                    until = time.monotonic() + 30
                    while answered() and not release.wait(0.005) and time.monotonic() < until:
                        pass  # held; a request arriving meanwhile is taken in at once
                busy = original()
                taken[0] += busy
                return busy

            monkeypatch.setattr(engine, "submit", submitted)
            monkeypatch.setattr(engine, "step", step)
        return release

    def wait_idle(self, timeout: float = 20) -> None:
        """Until every engine has nothing running or waiting and no private page."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(
                not (e.stats().running or e.stats().waiting or e.stats().private_pages)
                for e in self.engines.values()
            ):
                return
            time.sleep(0.02)
        raise AssertionError(
            f"engines not idle after {timeout} s: {[e.stats() for e in self.engines.values()]}"
        )

    def close(self) -> None:
        if self.http is not None:
            self.loop.run(self.http.stop(0))
        self.loop.run(self.router.stop(0))
        self.loop.run(self.links.close())
        for name in list(self.workers):
            self.kill_worker(name)
        self.loop.stop()


def start_cluster(
    loaded: LoadedModel,
    workers: int = 2,
    router: RouterSection | None = None,
    security: SecuritySection | None = None,
    engine: EngineSection = ENGINE,
    http: bool = False,
    adapters: tuple[AdapterSection, ...] = (),
    metrics: MetricsSection | None = None,
) -> LocalCluster:
    """`http`: the HTTP API too, on a free port (else none: its default port is 8000).
    `adapters`: LoRA adapters every worker loads at start (config model.adapters). `metrics`:
    what the router counts (no metrics server is started here either way)."""
    router = replace(router or RouterSection(port=0), http_port=0 if http else None)
    config = ClusterConfig(
        model=ModelSection(served_name=SERVED_NAME, adapters=adapters),
        engine=engine,
        router=router,
        security=security or SecuritySection(),
        metrics=metrics or MetricsSection(),
    )
    loop = EventLoopThread("local-cluster")
    links = WorkerLinks(build_policy(config))
    service = RouterService(links, config)
    server = loop.run(start_router_server(config, links, service))
    cluster = LocalCluster(loaded, config, loop, links, service, server)
    cluster.http = loop.run(start_http_server(service, config))
    for index in range(workers):
        cluster.add_worker(f"worker-{index}")
    return cluster
