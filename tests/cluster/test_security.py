"""The public port: TLS, bearer tokens bound to tenants, and tenants never sharing a cache."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.client import Client, text_request
from cluster.client_tls import ClientTls
from cluster.config import SecuritySection
from tests.cluster.certs import make_certificates
from tests.cluster.local_cluster import LocalCluster, start_cluster
from worker.loader import LoadedModel

TOKENS = {"token-acme": "acme", "token-globex": "globex", "token-admin": "*"}
PROMPT = "Every worker keeps a radix tree over its pages, and the router knows which. " * 2


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def secured(tiny: LoadedModel, certs: dict[str, Path]) -> Iterator[LocalCluster]:
    security = SecuritySection(
        tls_cert=str(certs["cert"]), tls_key=str(certs["key"]), auth_tokens=TOKENS
    )
    cluster = start_cluster(tiny, security=security)
    yield cluster
    cluster.close()


def last(client: Client, tenant: str = "", text: str = PROMPT) -> object:
    request = text_request(text, max_tokens=3, tenant=tenant)
    return list(client.generate(request, timeout=30))[-1]


def test_tls_with_a_valid_token_serves(secured: LocalCluster, certs: dict[str, Path]) -> None:
    answer = last(Client(secured.target, "token-acme", ClientTls(certs["ca"])))
    assert answer.finished  # type: ignore[attr-defined]


def test_plaintext_is_refused_by_a_tls_server(secured: LocalCluster) -> None:
    with pytest.raises(grpc.RpcError) as err:
        last(Client(secured.target, "token-acme"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("token", [None, "", "token-acme-but-wrong", "TOKEN-ACME"])
def test_a_missing_or_wrong_token_is_unauthenticated(
    secured: LocalCluster, certs: dict[str, Path], token: str | None
) -> None:
    client = Client(secured.target, token, ClientTls(certs["ca"]))
    client.token = token  # not even $RADIXMESH_TOKEN
    for call in (lambda: last(client), client.stats):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "bearer token" in err.value.details()


def test_health_checks_need_no_token(secured: LocalCluster, certs: dict[str, Path]) -> None:
    credentials = grpc.ssl_channel_credentials(certs["ca"].read_bytes())
    with grpc.secure_channel(secured.target, credentials) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_a_token_cannot_reach_another_tenant(secured: LocalCluster, certs: dict[str, Path]) -> None:
    acme = Client(secured.target, "token-acme", ClientTls(certs["ca"]))
    with pytest.raises(grpc.RpcError) as err:
        last(acme, tenant="globex")
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "acme" in err.value.details()
    assert last(acme, tenant="acme").finished  # type: ignore[attr-defined]


def test_two_tenants_never_share_cached_tokens(
    secured: LocalCluster, certs: dict[str, Path]
) -> None:
    acme = Client(secured.target, "token-acme", ClientTls(certs["ca"]))
    globex = Client(secured.target, "token-globex", ClientTls(certs["ca"]))
    admin = Client(secured.target, "token-admin", ClientTls(certs["ca"]))
    first = last(acme)
    assert first.cached_prompt_tokens == 0  # type: ignore[attr-defined]
    assert last(acme).cached_prompt_tokens > 0  # type: ignore[attr-defined]  # same tenant hits
    assert last(globex).cached_prompt_tokens == 0  # type: ignore[attr-defined]
    assert last(admin, tenant="initech").cached_prompt_tokens == 0  # type: ignore[attr-defined]
    assert last(admin, tenant="acme").cached_prompt_tokens > 0  # type: ignore[attr-defined]


def test_mutual_tls_needs_a_client_certificate_from_the_ca(
    tiny: LoadedModel, certs: dict[str, Path]
) -> None:
    security = SecuritySection(
        tls_cert=str(certs["cert"]), tls_key=str(certs["key"]), tls_client_ca=str(certs["ca"])
    )
    cluster = start_cluster(tiny, security=security)
    try:
        root = certs["ca"].read_bytes()

        def ask(cert: str | None) -> grpc.StatusCode:
            credentials = grpc.ssl_channel_credentials(
                root,
                certs[f"{cert}_key"].read_bytes() if cert else None,
                certs[f"{cert}_cert"].read_bytes() if cert else None,
            )
            with grpc.secure_channel(cluster.target, credentials) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    return grpc.StatusCode.OK
                except grpc.RpcError as err:
                    return err.code()

        assert ask("client") == grpc.StatusCode.OK
        assert ask(None) == grpc.StatusCode.UNAVAILABLE
        assert ask("rogue") == grpc.StatusCode.UNAVAILABLE

        # The command line presents a client certificate, and verifies the server by a name
        # other than the address it dials (as over a port-forward).
        port = cluster.target.rsplit(":", 1)[1]
        flags = ["--tls-ca", str(certs["ca"]), "--tls-cert", str(certs["client_cert"])]
        flags += ["--tls-key", str(certs["client_key"]), "--target", f"127.0.0.1:{port}"]
        named = cli("generate", "--max-tokens", "2", *flags, "--tls-server-name", "localhost", "hi")
        assert named.returncode == 0, named.stderr
        assert "prompt tokens" in named.stderr and named.stdout.strip()
        wrong = cli("stats", *flags, "--tls-server-name", "elsewhere.example")
        assert wrong.returncode == 1 and "UNAVAILABLE" in wrong.stdout + wrong.stderr
        half = cli("stats", "--tls-ca", str(certs["ca"]), "--tls-cert", str(certs["client_cert"]))
        assert half.returncode == 2 and "--tls-key" in half.stdout + half.stderr
    finally:
        cluster.close()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "cluster.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_oversized_messages_are_refused(tiny: LoadedModel) -> None:
    from cluster.config import RouterSection

    cluster = start_cluster(tiny, router=RouterSection(port=0, max_message_bytes=2048))
    try:
        with pytest.raises(grpc.RpcError) as err:
            last(Client(cluster.target), text="x" * 10_000)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert last(Client(cluster.target), text="small").finished  # type: ignore[attr-defined]
    finally:
        cluster.close()


def test_admin_calls_need_an_all_tenant_token(
    secured: LocalCluster, certs: dict[str, Path]
) -> None:
    from protos.radixmesh.v1 import serving_pb2, serving_pb2_grpc

    credentials = grpc.ssl_channel_credentials(certs["ca"].read_bytes())
    with grpc.secure_channel(secured.target, credentials) as channel:
        admin = serving_pb2_grpc.AdminStub(channel)
        request = serving_pb2.SetPolicyRequest(policy="round_robin")
        with pytest.raises(grpc.RpcError) as err:
            admin.SetPolicy(request, metadata=[("authorization", "Bearer token-acme")], timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as err:
            admin.SetPolicy(request, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answer = admin.SetPolicy(
            request, metadata=[("authorization", "Bearer token-admin")], timeout=5
        )
        assert answer.previous == "cache_aware"


def test_a_token_cannot_abort_another_tenants_request(
    secured: LocalCluster, certs: dict[str, Path]
) -> None:
    acme = Client(secured.target, "token-acme", ClientTls(certs["ca"]))
    globex = Client(secured.target, "token-globex", ClientTls(certs["ca"]))
    stream = acme.generate(text_request(PROMPT, max_tokens=400, request_id="acme-1"))
    next(stream)
    assert globex.abort("acme-1") is False  # as if it did not exist
    assert acme.abort("acme-1") is True
    rest = list(stream)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
