"""How a client reaches a TLS port: the server's CA, optionally a client certificate (for mutual
TLS) and the name to verify the server's certificate against (a port-forward or an IP address
reaches a server whose certificate names something else)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc


class TlsOptionsError(ValueError):
    """The client's TLS flags do not fit together, or name a file that cannot be read."""


def _read(flag: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise TlsOptionsError(f"{flag} {path}: cannot be read ({err.strerror or err})") from err


@dataclass(frozen=True)
class ClientTls:
    ca: Path
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise TlsOptionsError("--tls-cert and --tls-key go together (mutual TLS needs both)")
        self.credentials()  # a missing or unreadable file fails here, before any call

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            _read("--tls-ca", self.ca),
            _read("--tls-key", self.key) if self.key else None,
            _read("--tls-cert", self.cert) if self.cert else None,
        )

    def options(self) -> list[tuple[str, str]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-ca", type=Path, default=None, help="CA certificate of the server")
    parser.add_argument("--tls-cert", type=Path, default=None, help="client certificate (mTLS)")
    parser.add_argument("--tls-key", type=Path, default=None, help="client key (mTLS)")
    parser.add_argument(
        "--tls-server-name", default=None, help="name the server's certificate must carry"
    )


def tls_from_args(args: argparse.Namespace) -> ClientTls | None:
    """None for plaintext; refuses client-certificate or server-name flags without --tls-ca."""
    if args.tls_ca is None:
        if args.tls_cert or args.tls_key or args.tls_server_name:
            raise TlsOptionsError("--tls-cert, --tls-key and --tls-server-name need --tls-ca")
        return None
    return ClientTls(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
