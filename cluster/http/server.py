"""uvicorn serving the HTTP API on the router's own event loop (the one its gRPC server runs
on), so a request goes from the socket to the serving core without crossing a thread.

The socket is bound here, not by uvicorn (which exits the process when a bind fails): a port in
use is an OSError naming the address, as for the gRPC port. TLS takes the same files as gRPC:
`security.tls_cert` and `tls_key` make it HTTPS only, `tls_client_ca` requires client
certificates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from dataclasses import dataclass

import uvicorn

from cluster.config import ClusterConfig
from cluster.http.app import HttpApi, build_app
from cluster.router_service import RouterService

log = logging.getLogger(__name__)


@dataclass
class HttpServer:
    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int
    api: HttpApi
    scheme: str

    async def stop(self, grace: float) -> None:
        """Stop taking connections; give the requests in flight `grace` seconds; stop, with the
        background responses and the batches still running."""
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.task), grace + 1.0)
        self.task.cancel()
        with contextlib.suppress(TimeoutError):  # their worker calls closed, not left to the GC
            await asyncio.wait_for(self.api.background.close(), grace + 1.0)
        with contextlib.suppress(TimeoutError):  # the batches still running end cancelled
            await asyncio.wait_for(self.api.batches.close(), grace + 1.0)
        for store in (self.api.responses, self.api.chat_store, self.api.conversations):
            await asyncio.to_thread(store.close)  # what waits to be written (router.state_dir)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot serve HTTP on {host}:{port}: {err.strerror}") from err
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def start_http_server(
    service: RouterService, config: ClusterConfig, grace: float = 1.0
) -> HttpServer | None:
    """The HTTP API at `router.host:router.http_port` (None when http_port is null)."""
    router, security = config.router, config.security
    if router.http_port is None:
        return None
    app, api = build_app(service, config)
    await api.batches.resume()  # those a router before this one left running go on
    tls: dict[str, object] = {}
    if security.tls_cert and security.tls_key:
        tls = {"ssl_certfile": security.tls_cert, "ssl_keyfile": security.tls_key}
        if security.tls_client_ca:
            tls |= {"ssl_ca_certs": security.tls_client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    settings = uvicorn.Config(
        app,
        host=router.host,
        port=router.http_port,
        http="httptools",
        lifespan="off",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(max(1, grace)),
        **tls,  # type: ignore[arg-type]
    )
    settings.load()  # a TLS file that cannot be read fails here, naming it
    sock = bind(router.host, router.http_port)
    server = uvicorn.Server(settings)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise RuntimeError("the HTTP server stopped while starting")
        await asyncio.sleep(0.005)
    port = sock.getsockname()[1]
    scheme = "https" if tls else "http"
    log.info("HTTP API on %s://%s:%d", scheme, router.host, port)
    return HttpServer(server, task, port, api, scheme)
