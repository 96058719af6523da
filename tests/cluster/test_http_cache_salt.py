"""vLLM's `cache_salt` through the `openai` SDK over real HTTP on loopback to a local cluster of
two tiny-model workers: a prompt sent again with the same salt reads its prefix from the cache;
with another salt, or none, it reads nothing a salted request computed (and a salted request
nothing an unsalted one did), on chat, completions, embeddings and the Responses API; the
answer is the same whatever the salt; a bad salt is refused by name. Below the HTTP face, a
salt changes a namespace's block hashes and an unsalted namespace keeps the ones it had."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx2 as httpx
import openai
import pytest

from cache.identity import BlockHasher, IdentityScheme
from cache.namespace import CacheNamespace
from cluster.requests import request_namespace
from cluster.serving_call import ANY_TENANT
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster, start_cluster
from tests.cluster.test_http_openai import assert_no_leak
from tests.cluster.tool_fixtures import served
from worker.loader import LoadedModel
from worker.wire import namespace_from_proto, namespace_to_proto

MODEL = SERVED_NAME
DOCUMENT = "Salted caches keep one user's prompts from another's timing. " * 6


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(tiny, ENGINE)


def chat(client: openai.OpenAI, question: str, salt: str | None) -> Any:
    extra = {} if salt is None else {"cache_salt": salt}
    messages = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": question}]
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, extra_body=extra
    )


def cached(answer: Any) -> int:
    return int(answer.usage.prompt_tokens_details.cached_tokens or 0)


def test_only_the_same_salt_reads_a_salted_prefix(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    first = chat(client, "What is kept?", "salt-alice-3f9a")
    assert cached(first) == 0
    cluster.wait_idle()
    again = chat(client, "What is kept apart?", "salt-alice-3f9a")
    assert cached(again) > 0  # the system prompt, from the cache
    other = chat(client, "What is kept?", "salt-bob-77c1")
    assert cached(other) == 0
    assert other.choices[0].message.content == first.choices[0].message.content
    unsalted = chat(client, "What is kept?", None)
    assert cached(unsalted) == 0  # nothing a salted request computed
    cluster.wait_idle()
    assert cached(chat(client, "And then?", None)) > 0  # unsalted requests share as before
    assert cached(chat(client, "And then?", "salt-carol-0b2e")) == 0  # nor the other way
    assert_no_leak(cluster)


def test_completions_embeddings_and_responses_take_a_salt(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    prompt = DOCUMENT + "Completions:"
    salted = {"extra_body": {"cache_salt": "salt-completions"}}
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **salted)
    cluster.wait_idle()
    hit = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **salted)
    assert cached(hit) > 0
    miss = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, extra_body={"cache_salt": "salt-other"}
    )
    assert cached(miss) == 0
    text = DOCUMENT + "Embeddings."
    client.embeddings.create(model=MODEL, input=text, extra_body={"cache_salt": "salt-e"})
    cluster.wait_idle()
    again = client.embeddings.create(model=MODEL, input=text, extra_body={"cache_salt": "salt-e"})
    other = client.embeddings.create(model=MODEL, input=text, extra_body={"cache_salt": "salt-f"})
    # the same vector (to rounding: one read its prefix's KV from the cache, one computed it)
    assert again.data[0].embedding == pytest.approx(other.data[0].embedding, abs=1e-4)
    assert_no_leak(cluster)
    body = {"model": MODEL, "input": DOCUMENT + "Responses.", "max_output_tokens": 2}
    client.responses.create(**body, extra_body={"cache_salt": "salt-r"})  # type: ignore[call-overload]
    cluster.wait_idle()
    hit_r = client.responses.create(**body, extra_body={"cache_salt": "salt-r"})  # type: ignore[call-overload]
    miss_r = client.responses.create(**body, extra_body={"cache_salt": "salt-s"})  # type: ignore[call-overload]
    assert hit_r.usage.input_tokens_details.cached_tokens > 0
    assert miss_r.usage.input_tokens_details.cached_tokens == 0
    assert_no_leak(cluster)


@pytest.mark.parametrize(
    ("salt", "why"),
    [("", "cache_salt: must be a non-empty string"), ("x" * 1025, "at most 1024 characters")],
)
def test_a_bad_salt_is_refused_by_name(
    client: openai.OpenAI, cluster: LocalCluster, salt: str, why: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=why):
        chat(client, "Refused?", salt)
    with pytest.raises(openai.BadRequestError, match=why):
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=1, extra_body={"cache_salt": salt}
        )
    assert chat(client, "Still serving?", "fine").choices  # the cluster serves on
    assert_no_leak(cluster)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
def test_a_salt_that_is_not_unicode_text_is_refused_by_name(
    cluster: LocalCluster, path: str
) -> None:
    asked = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]},
        "/v1/completions": {"prompt": "x"},
        "/v1/embeddings": {"input": "x"},
    }
    body: dict[str, Any] = {"model": MODEL, **asked[path]}
    raw = json.dumps(body | {"cache_salt": "\ud800"})  # a lone surrogate, escaped
    answer = httpx.post(
        cluster.http_url + path,
        content=raw,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert answer.status_code == 400, answer.text
    assert "cache_salt" in answer.json()["error"]["message"]


def test_a_cluster_with_a_worker_before_salts_refuses_salted_requests(
    client: openai.OpenAI, cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that does not say it keeps salts (WorkerInfo.cache_salts false: an older
    release, as in a rolling upgrade) would serve a salted request from the unsalted cache:
    the router refuses salted requests by name, and serves the rest."""
    links = cluster.service.links
    assert links.limits is not None and links.limits.cache_salts  # today's workers say so
    monkeypatch.setattr(links, "limits", replace(links.limits, cache_salts=False))
    with pytest.raises(openai.BadRequestError, match="predates cache salts"):
        chat(client, "Refused?", "salt-x")
    assert chat(client, "Served?", None).choices
    assert_no_leak(cluster)


def test_a_salted_request_is_not_routed_to_a_worker_attached_without_salts(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """The cluster's limits said salts are kept when the request was checked, and a worker
    without them attached before it was routed (the limits as they stood at the check): the
    router refuses it by name rather than have that worker serve it from the unsalted cache."""
    links = cluster.service.links
    assert links.limits is not None and links.limits.cache_salts
    try:
        for link in links.links.values():
            link.info.cache_salts = False  # as an older release describes itself
        routed = cluster.service.counters.routed
        with pytest.raises(openai.BadRequestError, match="predates cache salts"):
            chat(client, "Routed?", "salt-z")
        assert cluster.service.counters.routed == routed  # refused, not counted as routed
        assert chat(client, "Served?", None).choices
    finally:
        for link in links.links.values():
            link.info.cache_salts = True
    assert_no_leak(cluster)


def test_the_router_keeps_a_digest_of_the_salt_not_the_salt() -> None:
    """From the router on, the namespace holds a fixed-size digest: the client's secret is not
    written to a saved cache, nor held at its length in every tree and index."""
    message = serving_pb2.GenerateRequest()
    message.namespace.tenant = "acme"
    message.namespace.cache_salt = "the-client-secret" * 40
    salted = request_namespace(message, ANY_TENANT)
    assert salted.salt is not None and len(salted.salt) == 32
    assert "secret" not in salted.salt
    message.namespace.cache_salt = "another"
    assert request_namespace(message, ANY_TENANT).salt not in (None, salted.salt)
    message.namespace.cache_salt = ""
    assert request_namespace(message, ANY_TENANT) == CacheNamespace(tenant="acme")


def test_a_salt_changes_the_chain_and_none_keeps_it() -> None:
    hasher = BlockHasher(IdentityScheme(block_size=4, model_revision="m"))
    plain = CacheNamespace(tenant="acme")
    seeds = {
        hasher.namespace_seed(ns)
        for ns in (
            plain,
            CacheNamespace(tenant="acme", salt="a"),
            CacheNamespace(tenant="acme", salt="b"),
        )
    }
    assert len(seeds) == 3
    # an unsalted namespace's seed is the one it had: tests/cache's golden vectors pin it
    salted = CacheNamespace(adapter="lora@1", tenant="acme", salt="s")
    assert namespace_from_proto(namespace_to_proto(salted)) == salted
    assert namespace_from_proto(namespace_to_proto(plain)) == plain


def test_salts_come_back_when_the_worker_before_them_goes(tiny: LoadedModel) -> None:
    """The refusal lasts while a worker without salts is attached, not until a restart."""
    cluster = start_cluster(tiny, http=True, engine=ENGINE)
    try:
        links = cluster.service.links
        assert links.limits is not None
        links.links["worker-1"].info.cache_salts = False  # as an older release describes itself
        links.limits = replace(links.limits, cache_salts=False)  # as its attach left them
        with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="x", max_retries=0) as oa:
            with pytest.raises(openai.BadRequestError, match="predates cache salts"):
                chat(oa, "Refused?", "salt-y")
            cluster.loop.run(links.detach("worker-0"))  # another goes: still refused
            with pytest.raises(openai.BadRequestError, match="predates cache salts"):
                chat(oa, "Refused?", "salt-y")
            cluster.loop.run(links.detach("worker-1"))
            assert links.limits.cache_salts  # no worker left without them
    finally:
        cluster.close()
