"""Each tenant's usage, as the router counts it (cluster/tenant_usage.py): over real gRPC on
loopback, the counts equal what each tenant's calls were sent; a token bound to a tenant sees
only its own; past metrics.max_tenants calls are counted together; the metrics carry a
`tenant` label."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from cluster.client import Client, text_request
from cluster.config import MetricsSection, SecuritySection
from cluster.router_metrics import RouterCollector
from cluster.tenant_usage import TenantUsage, TenantUsageBook
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import LocalCluster, start_cluster
from worker.loader import LoadedModel

TOKENS = {"t-acme": "acme", "t-beta": "beta", "t-any": "*"}
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 3


@pytest.fixture
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    """Each test its own router: its counts start at nothing."""
    cluster = start_cluster(
        tiny,
        workers=1,
        security=SecuritySection(auth_tokens=TOKENS),
        metrics=MetricsSection(max_tenants=3),
    )
    yield cluster
    cluster.close()


def served(client: Client, request: serving_pb2.GenerateRequest) -> TenantUsage:
    """What one call was sent: its prompt and cached tokens (the first message), its tokens."""
    stream = list(client.generate(request, timeout=60))
    assert stream[-1].finished
    first = stream[0]
    generated = sum(len(m.token_ids) for m in stream)
    return TenantUsage(1, first.prompt_tokens, first.cached_prompt_tokens, generated)


def total(*calls: TenantUsage) -> TenantUsage:
    return TenantUsage(
        sum(c.requests for c in calls),
        sum(c.prompt_tokens for c in calls),
        sum(c.cached_tokens for c in calls),
        sum(c.generated_tokens for c in calls),
    )


def usage(row: serving_pb2.TenantStats) -> TenantUsage:
    return TenantUsage(row.requests, row.prompt_tokens, row.cached_tokens, row.generated_tokens)


def usage_of(client: Client, tenant: str) -> TenantUsage:
    """The tenant's row as `client` sees it (none yet: nothing used)."""
    rows = [usage(row) for row in client.stats().tenants if row.tenant == tenant]
    return rows[0] if rows else TenantUsage()


def test_each_tenant_is_counted_what_its_calls_were_sent(cluster: LocalCluster) -> None:
    acme, beta, anyone = (Client(cluster.target, token=t) for t in TOKENS)
    acme_calls = [
        served(acme, text_request(SYSTEM + "First?", max_tokens=5)),
        served(acme, text_request(SYSTEM + "Second?", max_tokens=3, n=2, temperature=0.8)),
    ]
    assert acme_calls[1].cached_tokens > 0, "the second call reused the first's prefix"
    beta_calls = [served(beta, text_request(SYSTEM + "Other?", max_tokens=4))]
    shared = [served(anyone, text_request("no tenant at all", max_tokens=2))]
    past = served(anyone, text_request("a fourth tenant", max_tokens=2, tenant="gamma"))
    with pytest.raises(grpc.RpcError):  # refused before any worker: not a call served
        list(acme.generate(text_request("x", temperature=-1)))
    stats = anyone.stats()
    rows = {row.tenant: usage(row) for row in stats.tenants}
    assert rows == {"acme": total(*acme_calls), "beta": total(*beta_calls), "": total(*shared)}
    assert stats.uncounted_tenant_requests == past.requests == 1
    assert [row.tenant for row in stats.tenants] == ["acme", "beta", ""]  # first served first
    own = acme.stats()  # a token bound to a tenant sees its own usage alone
    assert [usage(row) for row in own.tenants] == [total(*acme_calls)]
    assert own.uncounted_tenant_requests == 0
    registry = CollectorRegistry()
    registry.register(RouterCollector(cluster.service))
    scraped = generate_latest(registry).decode()
    expected = {"acme": total(*acme_calls), "": total(*shared)}
    for tenant, counted in expected.items():
        for field in ("requests", "prompt_tokens", "cached_tokens", "generated_tokens"):
            line = f'radixmesh_router_tenant_{field}_total{{tenant="{tenant}"}}'
            assert f"{line} {float(getattr(counted, field))}" in scraped, scraped
    assert "radixmesh_router_uncounted_tenant_requests_total 1.0" in scraped
    assert 'tenant="gamma"' not in scraped


def test_a_call_whose_client_leaves_mid_stream_counts_what_it_was_sent(
    cluster: LocalCluster,
) -> None:
    beta = Client(cluster.target, token="t-beta")
    before = usage_of(beta, "beta")
    request = text_request(SYSTEM + "Long?", max_tokens=400)
    request.sampling.min_tokens = 400  # no end of its own: only the cancel ends it early
    stream = beta.generate(request, timeout=60)
    first = next(stream)
    assert not first.finished
    stream.cancel()  # the client goes away after its first message
    cluster.wait_idle()
    deadline = time.monotonic() + 10
    while cluster.service.in_flight:  # the router's end of the call, counted as it ends
        assert time.monotonic() < deadline
        time.sleep(0.02)
    after = usage_of(beta, "beta")
    assert after.requests == before.requests + 1
    assert after.prompt_tokens == before.prompt_tokens + first.prompt_tokens
    sent = after.generated_tokens - before.generated_tokens
    assert len(first.token_ids) <= sent < 400  # what went out before the cancel, not all 400


@given(
    st.integers(0, 4),
    st.lists(
        st.tuples(st.sampled_from(["", "a", "b", "c", "d", "e"]), st.integers(0, 50)),
        max_size=40,
    ),
)
def test_the_book_keeps_at_most_its_bound_and_counts_every_call(
    bound: int, calls: list[tuple[str, int]]
) -> None:
    book = TenantUsageBook(bound)
    kept: list[str] = []
    for tenant, tokens in calls:
        book.add(tenant or None, tokens, tokens // 2, tokens + 1)
        if tenant not in kept and len(kept) < bound:
            kept.append(tenant)
    assert list(book.tenants) == kept
    counted = [(t, n) for t, n in calls if t in kept]
    assert sum(u.requests for u in book.tenants.values()) + book.uncounted_requests == len(calls)
    assert book.uncounted_requests == len(calls) - len(counted)
    for tenant, got in book.tenants.items():
        mine = [n for t, n in counted if t == tenant]
        assert got == TenantUsage(len(mine), sum(mine), sum(n // 2 for n in mine),
                                  sum(n + 1 for n in mine))  # fmt: skip
