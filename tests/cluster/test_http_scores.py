"""vLLM's score and rerank APIs (cluster/http/scores.py) on a local cluster of two tiny-model
workers, over raw HTTP as Jina's, Cohere's and vLLM's clients send them: each score is the
cosine of the two texts' embeddings as `/v1/embeddings` gives them; rerank answers the best
first, `top_n` of them, with or without their texts; a text given twice is embedded once; a
document reranked again reads its KV from the cache; every refusal names its text."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import numpy as np
import openai
import pytest

from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster
from tests.cluster.test_http_openai import assert_no_leak
from tests.cluster.tool_fixtures import served
from worker.loader import LoadedModel

DOCUMENTS = [
    "A radix tree shares the prefixes of the keys it holds.",
    "Bananas ripen faster next to apples.",
    "The router sends each prompt to the worker that caches its prefix.",
]


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(tiny, ENGINE)


def post(cluster: LocalCluster, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{cluster.http_url}{path}", json=body, timeout=60)


def vectors(client: openai.OpenAI, texts: list[str]) -> np.ndarray:
    data = client.embeddings.create(model=SERVED_NAME, input=texts, encoding_format="float").data
    return np.asarray([d.embedding for d in data])


def test_rerank_orders_documents_by_the_cosine_of_their_embeddings(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    query, documents = "Which worker holds my prefix?", DOCUMENTS[:3]
    expected = vectors(client, documents) @ vectors(client, [query])[0]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        answer = post(cluster, path, {"query": query, "documents": documents})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["model"] == SERVED_NAME and body["id"].startswith("rerank-")
        results = body["results"]
        assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -expected[i])
        for r in results:
            assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)
            assert r["document"] == {"text": documents[r["index"]]}
    assert answer.headers["x-radixmesh-worker"]  # which worker served, as for embeddings
    assert cluster.service.counters.http_responses[("/v2/rerank", 200)] >= 1
    top = post(cluster, "/v1/rerank", {"query": query, "documents": documents, "top_n": 2,
                                       "return_documents": False}).json()  # fmt: skip
    assert [r["index"] for r in top["results"]] == [r["index"] for r in results][:2]
    assert all(r["document"] is None for r in top["results"])
    assert_no_leak(cluster)


def test_scores_pair_one_with_many_many_with_one_and_in_order(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    a, b = DOCUMENTS[:2], DOCUMENTS[1:3]
    va, vb = vectors(client, a), vectors(client, b)
    cases = [
        ({"text_1": a[0], "text_2": b}, [va[0] @ vb[0], va[0] @ vb[1]]),
        ({"text_1": a, "text_2": b[0]}, [va[0] @ vb[0], va[1] @ vb[0]]),
        ({"text_1": a, "text_2": b}, [va[0] @ vb[0], va[1] @ vb[1]]),
        ({"text_1": a[0], "text_2": a[0]}, [1.0]),
    ]
    for body, expected in cases:
        for path in ("/v1/score", "/score"):
            answer = post(cluster, path, {"model": SERVED_NAME, **body})
            assert answer.status_code == 200, answer.text
            data = answer.json()["data"]
            assert [d["index"] for d in data] == list(range(len(expected)))
            assert [d["score"] for d in data] == pytest.approx(expected, abs=1e-5)
    assert_no_leak(cluster)


def test_a_text_given_twice_is_embedded_once_and_a_document_again_reads_the_cache(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    documents = [f"Document {i}: " + "routing keeps prefixes where they are cached. " * 3
                 for i in range(3)]  # fmt: skip
    once = client.embeddings.create(model=SERVED_NAME, input=["first query", *documents])
    twice = post(cluster, "/v1/rerank", {"query": "first query", "documents": documents * 2})
    assert twice.json()["usage"]["total_tokens"] == once.usage.prompt_tokens
    assert len(twice.json()["results"]) == 6
    cached = cluster.service.counters.actual_cached_tokens
    again = post(cluster, "/v1/rerank", {"query": "a second query", "documents": documents})
    assert again.status_code == 200
    document_tokens = (
        once.usage.prompt_tokens
        - client.embeddings.create(model=SERVED_NAME, input="first query").usage.prompt_tokens
    )
    # each document but its last page or so was read from the cache
    assert cluster.service.counters.actual_cached_tokens - cached > 0.6 * document_tokens


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/v1/rerank", {"query": "q", "documents": ["fine", ""]}, "documents[1]", "is empty"),
        ("/v1/rerank", {"query": "", "documents": ["fine"]}, "query", "is empty"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents", "at least one"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n", ">= 0"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "max_chunks": 2}, "max_chunks", ""),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", "as many"),
        ("/v1/score", {"text_1": [], "text_2": "c"}, "text_1", "at least one"),
        ("/v1/score", {"text_1": "a", "text_2": ["b", ""]}, "text_2[1]", "is empty"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "model": "nope"}, "model", "does not exist"),
        ("/v1/score", {"text_1": "", "text_2": ["b"]}, "text_1", "is empty"),
        (
            "/v1/rerank",
            {"query": "q", "documents": [f"d{i}" for i in range(2048)] + ["d0"] * 5},
            "documents",
            "2049 distinct texts",
        ),
    ],
)
def test_every_refusal_names_its_text(
    cluster: LocalCluster, path: str, body: dict[str, Any], param: str, says: str
) -> None:
    answer = post(cluster, path, body)
    assert answer.status_code in (400, 404), answer.text
    error = answer.json()["error"]
    assert error["param"] == param or param in error["message"], error
    assert says in error["message"], error
    assert_no_leak(cluster)
