"""Ask a radixmesh router whether it serves: the standard gRPC health service
(grpc.health.v1.Health/Check), or with --http PATH a GET of the HTTP API's PATH (/health).

    python health_check.py --port 50051 [--host H] [--service NAME | --http PATH]
                           [--tls-ca CA --server-name NAME [--tls-cert CERT --tls-key KEY]]

Exit 0 when the service is SERVING (HTTP: the answer is 200), 1 otherwise (the status or the
error is printed). The chart's probes use it where the kubelet's own probes cannot go: a TLS-only
gRPC port, and mutual TLS on either port (the kubelet presents no client certificate); `helm
test` uses it through the Service. Health checks need no bearer token.
"""

from __future__ import annotations

import argparse
import http.client
import ssl
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def channel(args: argparse.Namespace) -> grpc.Channel:
    target = f"{args.host}:{args.port}"
    if args.tls_ca is None:
        return grpc.insecure_channel(target)
    key = args.tls_key.read_bytes() if args.tls_key else None
    cert = args.tls_cert.read_bytes() if args.tls_cert else None
    credentials = grpc.ssl_channel_credentials(args.tls_ca.read_bytes(), key, cert)
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    return grpc.secure_channel(target, credentials, options=options)


def check_grpc(args: argparse.Namespace) -> int:
    with channel(args) as open_channel:
        stub = health_pb2_grpc.HealthStub(open_channel)
        try:
            response = stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as err:
            print(f"{args.host}:{args.port} {args.service!r}: {err.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(f"{args.host}:{args.port} {args.service!r}: {status}")
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


class _TlsConnection(http.client.HTTPConnection):
    """HTTPS that dials one address and checks the certificate against another name (the
    kubelet dials 127.0.0.1; the certificate names the Service), as gRPC's target override."""

    def __init__(self, host: str, port: int, timeout: float, context: ssl.SSLContext, name: str):
        super().__init__(host, port, timeout=timeout)
        self.context, self.name = context, name

    def connect(self) -> None:
        super().connect()
        self.sock = self.context.wrap_socket(self.sock, server_hostname=self.name)


def check_http(args: argparse.Namespace) -> int:
    where = f"{'https' if args.tls_ca else 'http'}://{args.host}:{args.port}{args.http}"
    connection: http.client.HTTPConnection
    if args.tls_ca is None:
        connection = http.client.HTTPConnection(args.host, args.port, timeout=args.timeout)
    else:
        context = ssl.create_default_context(cafile=str(args.tls_ca))
        if args.tls_cert is not None:
            context.load_cert_chain(args.tls_cert, args.tls_key)
        name = args.server_name or args.host
        connection = _TlsConnection(args.host, args.port, args.timeout, context, name)
    try:
        connection.request("GET", args.http)
        response = connection.getresponse()
        body = response.read(512).decode("utf-8", "replace").strip()
    except (OSError, http.client.HTTPException) as err:
        print(f"{where}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    finally:
        connection.close()
    ok = response.status == 200
    print(f"{where}: {response.status} {body}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--service", default="", help='gRPC: "" is the server as a whole')
    parser.add_argument("--http", default=None, metavar="PATH", help="GET this path over HTTP")
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--tls-ca", type=Path, default=None)
    parser.add_argument("--tls-cert", type=Path, default=None)
    parser.add_argument("--tls-key", type=Path, default=None)
    parser.add_argument("--server-name", default=None, help="the name the certificate must hold")
    args = parser.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.http is not None and not args.http.startswith("/"):
        parser.error("--http takes a path starting with /")
    return check_http(args) if args.http is not None else check_grpc(args)


if __name__ == "__main__":
    sys.exit(main())
