"""The HTTP API's security, over real HTTPS on loopback: TLS with the cluster's CA (plain HTTP and
unknown CAs refused), mutual TLS, and tokens bound to tenants that never share cached tokens (the
gRPC face shares the tenant's cache with the HTTP one)."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx2 as httpx
import openai
import pytest

from cluster.client import Client, text_request
from cluster.client_tls import ClientTls
from cluster.config import SecuritySection
from tests.cluster.certs import make_certificates
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster, start_cluster
from worker.loader import LoadedModel

MODEL = SERVED_NAME
TOKENS = {"token-acme": "acme", "token-globex": "globex", "token-admin": "*"}
PROMPT = "Every worker keeps a radix tree over its pages, and the router knows which. " * 2


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def secured(tiny: LoadedModel, certs: dict[str, Path]) -> Iterator[LocalCluster]:
    security = SecuritySection(
        tls_cert=str(certs["cert"]), tls_key=str(certs["key"]), auth_tokens=TOKENS
    )
    cluster = start_cluster(tiny, http=True, security=security)
    yield cluster
    cluster.close()


def trusting(certs: dict[str, Path], cert: str | None = None) -> ssl.SSLContext:
    """A client's TLS: the cluster's CA, and the certificate `cert` (client, rogue) if any."""
    context = ssl.create_default_context(cafile=certs["ca"])
    if cert:
        context.load_cert_chain(certs[f"{cert}_cert"], certs[f"{cert}_key"])
    return context


def client(cluster: LocalCluster, token: str, certs: dict[str, Path]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{cluster.http_url}/v1",
        api_key=token,
        max_retries=0,
        http_client=httpx.Client(verify=trusting(certs)),
    )


def test_https_serves_both_apis_with_the_ca(secured: LocalCluster, certs: dict[str, Path]) -> None:
    assert secured.http_url.startswith("https://")
    with client(secured, "token-acme", certs) as oa:
        answer = oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert answer.choices[0].message.role == "assistant"
    with anthropic.Anthropic(
        base_url=secured.http_url,
        api_key="token-acme",
        max_retries=0,
        http_client=httpx.Client(verify=trusting(certs)),
    ) as an:
        message = an.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert message.type == "message"
    assert httpx.get(f"{secured.http_url}/health", verify=trusting(certs)).status_code == 200


def test_plain_http_and_an_unknown_ca_are_refused(
    secured: LocalCluster, certs: dict[str, Path]
) -> None:
    plain = secured.http_url.replace("https://", "http://")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{plain}/health")
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{secured.http_url}/health")  # the system's CAs do not know ours
    with (
        openai.OpenAI(base_url=f"{secured.http_url}/v1", api_key="token-acme", max_retries=0) as oa,
        pytest.raises(openai.APIConnectionError),
    ):
        oa.models.list()
    with client(secured, "token-acme", certs) as oa:  # and it still serves
        assert [m.id for m in oa.models.list()] == [MODEL]


def cached(oa: openai.OpenAI, tenant: str = "") -> int:
    headers = {"X-Radixmesh-Tenant": tenant} if tenant else None
    answer = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_headers=headers)
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    return answer.usage.prompt_tokens_details.cached_tokens or 0


def test_tokens_of_two_tenants_never_share_cached_tokens(
    secured: LocalCluster, certs: dict[str, Path]
) -> None:
    counts = secured.service.counters.http_responses
    forbidden = counts.get(("/v1/completions", 403), 0)
    with (
        client(secured, "token-acme", certs) as acme,
        client(secured, "token-globex", certs) as globex,
        client(secured, "token-admin", certs) as admin,
    ):
        assert cached(acme) == 0
        assert cached(acme) > 0  # the same tenant hits its own cache
        assert cached(globex) == 0
        assert cached(globex) > 0  # and globex its own, apart
        assert cached(admin, "initech") == 0
        assert cached(admin, "acme") > 0  # an all-tenant token may name acme's
        with pytest.raises(openai.PermissionDeniedError, match="'acme'"):
            cached(acme, "globex")
    assert counts[("/v1/completions", 403)] == forbidden + 1
    grpc_acme = Client(secured.target, "token-acme", ClientTls(certs["ca"]))
    answer = list(grpc_acme.generate(text_request(PROMPT, max_tokens=2), timeout=30))[-1]
    assert answer.cached_prompt_tokens > 0  # gRPC and HTTP share acme's cache
    secured.wait_idle()


def test_mutual_tls_refuses_a_client_without_a_certificate_from_the_ca(
    tiny: LoadedModel, certs: dict[str, Path]
) -> None:
    security = SecuritySection(
        tls_cert=str(certs["cert"]), tls_key=str(certs["key"]), tls_client_ca=str(certs["ca"])
    )
    cluster = start_cluster(tiny, workers=1, http=True, security=security)

    try:
        with httpx.Client(verify=trusting(certs, "client")) as http:
            assert http.get(f"{cluster.http_url}/health").status_code == 200
        for cert in (None, "rogue"):
            with (
                httpx.Client(verify=trusting(certs, cert)) as http,
                pytest.raises(httpx.TransportError),
            ):
                http.get(f"{cluster.http_url}/health")
        with openai.OpenAI(
            base_url=f"{cluster.http_url}/v1",
            api_key="none",
            max_retries=0,
            http_client=httpx.Client(verify=trusting(certs, "client")),
        ) as oa:
            assert oa.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
    finally:
        cluster.close()
