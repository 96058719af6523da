"""Speculative decoding served: `engine.num_speculative_tokens` reaches each worker's engine
from the cluster config, and clients of the HTTP API (the openai SDK) and of gRPC read the same
answers from a cluster that speculates as from one that does not, streamed or whole, while the
workers' drafts are kept (worker/speculation.py; the engine-level tests are in
tests/worker/test_speculative_decoding.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import openai
import pytest

from cluster.client import Client, text_request
from cluster.router_metrics import RouterCollector
from tests.cluster.local_cluster import ENGINE, LocalCluster, start_cluster
from tests.prometheus_text import histograms
from worker.loader import LoadedModel

MESSAGES = [{"role": "user", "content": "one two one two one two one two one two"}]
PROMPT = "one two one two one two one two"


@pytest.fixture(scope="module")
def clusters(tiny: LoadedModel) -> Iterator[dict[int, LocalCluster]]:
    """One worker each: drafts of up to 4 tokens, and none."""
    running = {
        k: start_cluster(
            tiny, workers=1, http=True, engine=replace(ENGINE, num_speculative_tokens=k)
        )
        for k in (0, 4)
    }
    yield running
    for cluster in running.values():
        cluster.close()


def _drafts_kept(cluster: LocalCluster) -> int:
    return sum(engine.stats().accepted_draft_tokens for engine in cluster.engines.values())


def test_the_setting_reaches_the_workers(clusters: dict[int, LocalCluster]) -> None:
    for k, cluster in clusters.items():
        assert [e.speculation.num_speculative_tokens for e in cluster.engines.values()] == [k]


def test_chats_and_streams_read_the_same_through_the_openai_sdk(
    clusters: dict[int, LocalCluster],
) -> None:
    answers: dict[int, list[str]] = {}
    for k, cluster in clusters.items():
        client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0)
        chat = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=48, temperature=0,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        stream = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=48, temperature=0.7, seed=3, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        streamed = "".join(event.choices[0].text for event in stream if event.choices)
        assert chat.usage is not None and chat.usage.completion_tokens == 48
        answers[k] = [chat.choices[0].message.content or "", streamed]
        client.close()
    assert answers[4] == answers[0]
    assert _drafts_kept(clusters[4]) > 0 and _drafts_kept(clusters[0]) == 0


def test_grpc_reads_the_same(clusters: dict[int, LocalCluster]) -> None:
    texts = {}
    for k, cluster in clusters.items():
        client = Client(cluster.target)
        try:
            request = text_request(PROMPT, max_tokens=40, temperature=0.0)
            request.sampling.ignore_eos = True
            texts[k] = "".join(r.text for r in client.generate(request, timeout=60))
        finally:
            client.close()
    assert texts[4] == texts[0] and texts[0]


def test_the_router_times_a_gap_before_every_token_but_the_first_of_drafted_steps_too(
    clusters: dict[int, LocalCluster],
) -> None:
    """The router's inter-token histogram (cluster/request_latency.py) counts one gap per token
    after the first when a worker keeps several drafted tokens a step: each token is a message
    of its own."""
    cluster = clusters[4]
    gap = "radixmesh_router_inter_token_latency_seconds"
    before, kept = histograms(RouterCollector(cluster.service))[gap], _drafts_kept(cluster)
    client = Client(cluster.target)
    try:
        request = text_request(PROMPT, max_tokens=40, temperature=0.0)
        request.sampling.ignore_eos = True
        tokens = sum(len(m.token_ids) for m in client.generate(request, timeout=60))
    finally:
        client.close()
    assert tokens == 40 and _drafts_kept(cluster) > kept
    got = histograms(RouterCollector(cluster.service))[gap].minus(before)
    assert got.count == 40 - 1
