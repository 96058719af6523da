"""Building and starting a grpc.aio server the way every radixmesh server runs.

Standard health checking (`grpc.health.v1.Health`, the overall service "" and each named
service), server reflection, message-size and concurrent-stream limits, optional TLS (with an
optional client CA for mutual TLS), and any interceptors (the router's bearer-token check).
Requests that do not decode get INVALID_ARGUMENT (worker/wire_errors.py), after those
interceptors have let the caller in.
Binds the given host only; port 0 picks a free port, returned by `start`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from worker.wire_errors import WireErrorInterceptor

MiB = 1 << 20
INTERNAL_MESSAGE_BYTES = 64 * MiB
"""The message cap between the router and its workers, both ways: a worker's tokenizer goes to
the router in one message (SmolLM2's tokenizer.json alone is 3.5 MB)."""


def internal_message_bytes(max_images: int = 0, max_image_bytes: int = 0) -> int:
    """What a worker's server receives in one message: INTERNAL_MESSAGE_BYTES for everything
    but images (token ids, a tokenizer), and the most image bytes its limits let a request
    carry (engine max_images x max_image_bytes)."""
    return INTERNAL_MESSAGE_BYTES + max_images * max_image_bytes


@dataclass(frozen=True)
class TlsConfig:
    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None
    """With a client CA, clients must present a certificate it signed (mutual TLS)."""

    def credentials(self) -> grpc.ServerCredentials:
        ca = self.client_ca_file.read_bytes() if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(self.key_file.read_bytes(), self.cert_file.read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )


@dataclass(frozen=True)
class ServerLimits:
    max_message_bytes: int = 4 * MiB
    max_concurrent_streams: int = 256
    """Per client connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS)."""


@dataclass
class GrpcServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    services: list[str] = field(default_factory=list)

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.services]:
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)


async def start_server(
    register: Sequence[tuple[Callable[[object, grpc.aio.Server], None], object, str]],
    host: str,
    port: int,
    limits: ServerLimits = ServerLimits(),
    tls: TlsConfig | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> GrpcServer:
    """Start a server for (add_*_to_server, servicer, full service name) triples."""
    options = [
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", limits.max_message_bytes),
        ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
        ("grpc.so_reuseport", 0),
    ]
    # grpc runs interceptors first to last, each around the next: the wire check goes last, so
    # a caller the others refuse (no bearer token) is refused whatever bytes it sent
    server = grpc.aio.server(options=options, interceptors=[*interceptors, WireErrorInterceptor()])
    names = []
    for add, servicer, name in register:
        add(servicer, server)
        names.append(name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    address = f"{host}:{port}"
    bound = (
        server.add_secure_port(address, tls.credentials())
        if tls is not None
        else server.add_insecure_port(address)
    )
    if bound == 0:
        raise OSError(f"gRPC could not bind {address}")
    await server.start()
    running = GrpcServer(server, health_servicer, bound, names)
    await running.set_serving(True)
    return running
