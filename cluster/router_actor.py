"""The router as a Ray actor: the public gRPC server and HTTP API, its policy, and Ray-backed
membership.

A plain class; the cluster wraps it with `ray.remote` and restarts it when it dies, on the same
port, so clients reconnect to the same endpoint. Its constructor takes only what Ray keeps
inline in the actor's creation task (the configuration and the workers' names, a few KB; a
handle among the arguments would put them in the object store): everything else a restart
needs, the tokenizer included, comes from the workers themselves over gRPC, so a restart never
depends on an object Ray may have released. Workers are named Ray actors it looks up: every
`poll_s` it asks each for its address; a worker that answers from a new address (Ray restarted
it) is attached again (its index starts from a snapshot), one that does not answer, or that Ray
cannot find, is detached until it does.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import ray

from cluster.auth import BearerTokenInterceptor
from cluster.config import ClusterConfig, build, grpc_message_bytes
from cluster.http.server import HttpServer, start_http_server
from cluster.policies import build_policy
from cluster.ray_runtime import actor_name
from cluster.router_admin import AdminService
from cluster.router_metrics import RouterCollector
from cluster.router_service import RouterService
from cluster.worker_links import IdentityRefused, WorkerLinks
from protos.radixmesh.v1 import serving_pb2_grpc
from worker.event_loop import EventLoopThread
from worker.grpc_server import GrpcServer, ServerLimits, TlsConfig, start_server
from worker.metrics import serve_metrics

log = logging.getLogger(__name__)


async def start_router_server(
    config: ClusterConfig, links: WorkerLinks, service: RouterService
) -> GrpcServer:
    """The public port at `config.router.host:port`: Serving and Admin behind the bearer-token
    interceptor, with TLS when `config.security` names a certificate."""
    router, security = config.router, config.security
    tls = None
    if security.tls_cert and security.tls_key:
        client_ca = Path(security.tls_client_ca) if security.tls_client_ca else None
        tls = TlsConfig(Path(security.tls_cert), Path(security.tls_key), client_ca)
    register = [
        (serving_pb2_grpc.add_ServingServicer_to_server, service, "radixmesh.v1.Serving"),
        (
            serving_pb2_grpc.add_AdminServicer_to_server,
            AdminService(links, config, service.clear_text_index, service.adapter_admin),
            "radixmesh.v1.Admin",
        ),
    ]
    return await start_server(
        register,
        router.host,
        router.port,
        ServerLimits(grpc_message_bytes(config), router.max_concurrent_streams),
        tls,
        [BearerTokenInterceptor(security)],
    )


class RouterActor:
    def __init__(
        self,
        config: dict[str, Any],
        workers: list[str],
        poll_s: float = 0.5,
    ) -> None:
        self.config = build(ClusterConfig, config, "")
        self.workers: dict[str, Any] = dict.fromkeys(workers)
        """Worker name -> its actor handle, looked up by name (None until Ray finds it)."""
        self._missing: set[str] = set()
        """Workers whose lookup failed, and was logged, since they were last found."""
        self._lookups: dict[str, asyncio.Future[Any]] = {}
        """Lookups by name still under way."""
        self.poll_s = poll_s
        self.links = WorkerLinks(build_policy(self.config))
        self.service = RouterService(self.links, self.config)
        self.loop = EventLoopThread("grpc-router")
        self.server: GrpcServer = self.loop.run(
            start_router_server(self.config, self.links, self.service)
        )
        self.http: HttpServer | None = self.loop.run(
            start_http_server(self.service, self.config, self.config.drain_timeout_s)
        )
        self.metrics_port = None
        if self.config.metrics.enabled:
            metrics = self.config.metrics
            collector = RouterCollector(self.service)
            self.metrics_port = serve_metrics(collector, metrics.host, metrics.router_port)
        self.loop.run(self._sync_members(), timeout=120)
        self._membership = asyncio.run_coroutine_threadsafe(self._keep_members(), self.loop.loop)

    async def _sync_members(self) -> None:
        for name in self.workers:
            try:
                handle = await self._handle(name)
                address = await asyncio.wait_for(
                    asyncio.wrap_future(handle.address.remote().future()), timeout=5
                )
            except Exception as err:  # the actor is dead or restarting: detach until it answers
                if name in self.links.links:
                    log.warning("worker %s is not answering (%s)", name, type(err).__name__)
                    await self.links.detach(name)
                continue
            link = self.links.links.get(name)
            if link is None or link.address != address:
                try:
                    await self.links.attach(name, address)
                except (IdentityRefused, Exception) as err:
                    log.warning("worker %s at %s not attached: %s", name, address, err)

    async def _handle(self, name: str) -> Any:
        """The worker's actor handle, looked up by its Ray name the first time, in the
        router's own namespace (its job's, where serve placed the workers); raises while Ray
        has no live actor of that name, saying so once."""
        handle = self.workers[name]
        if handle is not None:
            return handle
        lookup = self._lookups.get(name)
        if lookup is None:  # one lookup at a time: a slow one is awaited again, not repeated
            lookup = asyncio.ensure_future(asyncio.to_thread(ray.get_actor, actor_name(name)))
            self._lookups[name] = lookup
        try:
            handle = await asyncio.wait_for(asyncio.shield(lookup), timeout=5)
        except Exception as err:
            if lookup.done():
                del self._lookups[name]
            if name not in self._missing:
                self._missing.add(name)
                log.warning("worker %s not found in Ray (%r); looking again", name, err)
            raise
        del self._lookups[name]
        self._missing.discard(name)
        self.workers[name] = handle
        return handle

    async def _keep_members(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self._sync_members()

    def endpoint(self) -> str:
        return f"{self.config.router.host}:{self.server.port}"

    def http_url(self) -> str | None:
        """The HTTP API's base URL (None: off)."""
        if self.http is None:
            return None
        return f"{self.http.scheme}://{self.config.router.host}:{self.http.port}"

    def describe(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint(),
            "http_url": self.http_url(),
            "metrics_port": self.metrics_port,
            "pid": os.getpid(),
        }

    def healthy_workers(self) -> list[str]:
        return self.links.healthy

    def drain(self, timeout: float) -> bool:
        """Stop taking requests; wait up to `timeout` for the streams in flight; stop."""
        self._membership.cancel()

        async def drain() -> bool:
            await self.server.set_serving(False)
            if self.http is not None:
                self.http.api.draining = True
            deadline = asyncio.get_running_loop().time() + timeout
            while self.service.busy() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            idle = not self.service.busy()
            if self.http is not None:
                await self.http.stop(grace=1.0)
            await self.server.stop(grace=1.0)
            await self.links.close()
            return idle

        idle = self.loop.run(drain())
        self.loop.stop()
        return idle
