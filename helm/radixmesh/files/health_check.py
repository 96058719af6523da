"""Ask a gRPC server's standard health service (grpc.health.v1.Health/Check) for SERVING.

    python health_check.py --port 50051 [--host H] [--service NAME]
                           [--tls-ca CA --server-name NAME [--tls-cert CERT --tls-key KEY]]

Exit 0 when the service is SERVING, 1 otherwise (the status or the error is printed). The chart's
probes use it where the kubelet's own gRPC probe cannot go: a TLS-only port (mutual TLS
included); `helm test` uses it through the Service. Health checks need no bearer token.
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--service", default="", help='"" is the server as a whole')
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--tls-ca", type=Path, default=None)
    parser.add_argument("--tls-cert", type=Path, default=None)
    parser.add_argument("--tls-key", type=Path, default=None)
    parser.add_argument("--server-name", default=None, help="the name the certificate must hold")
    args = parser.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
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


if __name__ == "__main__":
    sys.exit(main())
