"""Test certificates: a throwaway CA and a server certificate for 127.0.0.1 / localhost."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_certificates(directory: Path) -> dict[str, Path]:
    """Write ca.pem, server.pem/key and client.pem/key (signed by the CA) and rogue.pem/key
    (self-signed) into `directory`; returns their paths."""
    now = datetime.datetime.now(datetime.UTC)
    later = now + datetime.timedelta(days=1)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("radixmesh test CA"))
        .issuer_name(_name("radixmesh test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(later)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(later)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": directory / "ca.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    _write(directory, "server", server, key, paths)
    for name, issuer_key in (("client", ca_key), ("rogue", None)):
        leaf_key = ec.generate_private_key(ec.SECP256R1())
        leaf = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(ca.subject if issuer_key else _name(name))
            .public_key(leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(later)
            .sign(issuer_key or leaf_key, hashes.SHA256())
        )
        _write(directory, name, leaf, leaf_key, paths)
    return paths


def _write(
    directory: Path,
    name: str,
    cert: x509.Certificate,
    key: ec.EllipticCurvePrivateKey,
    paths: dict[str, Path],
) -> None:
    prefix = "" if name == "server" else f"{name}_"
    paths[f"{prefix}cert"] = directory / f"{name}.pem"
    paths[f"{prefix}key"] = directory / f"{name}.key"
    paths[f"{prefix}cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[f"{prefix}key"].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
