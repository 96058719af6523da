"""OpenAI's embeddings API (`POST /v1/embeddings`) on a local cluster of two tiny-model workers,
through the `openai` SDK, raw HTTP and the router's gRPC service: each embedding is
transformers' final hidden state at the input's last token, whichever encoding the client asks
for; inputs are routed to the worker that holds their prefix and read it from its cache; a bad
input refuses the request naming it; a client that goes away cancels what is left; no request
or page outlives its call."""

from __future__ import annotations

import base64
import itertools
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx2 as httpx
import numpy as np
import openai
import pytest
import torch

from cluster.config import RouterSection
from cluster.http import embeddings
from protos.radixmesh.v1 import serving_pb2, serving_pb2_grpc
from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster, start_cluster
from tests.cluster.test_http_openai import assert_no_leak
from tests.cluster.tool_fixtures import served
from worker.loader import LoadedModel

MODEL = SERVED_NAME
DOCUMENT = "radixmesh routes each prompt to the worker that already holds its prefix. " * 3


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(tiny, ENGINE)


@pytest.fixture(scope="module")
def hf_model(tiny: LoadedModel) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModel.from_pretrained(tiny.path, dtype=torch.float32).eval()


def oracle(hf_model: torch.nn.Module, prompt: Sequence[int], normalize: bool = True) -> np.ndarray:
    with torch.no_grad():
        state = hf_model(torch.tensor([list(prompt)])).last_hidden_state[0, -1].numpy()
    return state / np.linalg.norm(state) if normalize else state


def close_to(got: Sequence[float], expected: np.ndarray) -> bool:
    return bool(np.linalg.norm(np.asarray(got) - expected) < 1e-5 * np.linalg.norm(expected))


def test_the_sdk_reads_base64_and_floats_alike_and_each_is_transformers_state(
    client: openai.OpenAI, cluster: LocalCluster, hf_model: torch.nn.Module
) -> None:
    inputs = [list(range(10, 50)), [*range(10, 30), 7, 8, 9]]
    default = client.embeddings.create(model=MODEL, input=inputs)  # the SDK asks for base64
    floats = client.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
    assert default.object == "list" and default.model == MODEL
    assert [d.index for d in default.data] == [0, 1]
    for i, prompt in enumerate(inputs):
        assert default.data[i].object == "embedding"
        # the second call read the first's KV from the cache: equal up to float32 rounding
        assert np.allclose(default.data[i].embedding, floats.data[i].embedding, atol=1e-6)
        assert close_to(floats.data[i].embedding, oracle(hf_model, prompt)), i
    assert default.usage.prompt_tokens == default.usage.total_tokens == 40 + 23
    raw = httpx.post(
        f"{cluster.http_url}/v1/embeddings",
        json={"model": MODEL, "input": inputs[0], "encoding_format": "base64"},
    ).json()
    values = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(values, floats.data[0].embedding, atol=1e-6)
    assert raw["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its prompt was cached
    assert_no_leak(cluster)


def test_dimensions_and_normalize(client: openai.OpenAI, hf_model: torch.nn.Module) -> None:
    prompt = list(range(40, 70))
    raw = oracle(hf_model, prompt, normalize=False)
    plain = client.embeddings.create(
        model=MODEL, input=prompt, encoding_format="float", extra_body={"normalize": False}
    )
    assert close_to(plain.data[0].embedding, raw)
    short = client.embeddings.create(model=MODEL, input=prompt, dimensions=8)
    (vector,) = [d.embedding for d in short.data]
    assert len(vector) == 8 and np.linalg.norm(vector) == pytest.approx(1, abs=1e-6)
    assert close_to(vector, raw[:8] / np.linalg.norm(raw[:8]))


def test_an_input_goes_to_the_worker_holding_its_prefix_and_reads_it_from_the_cache(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    first = client.embeddings.with_raw_response.create(model=MODEL, input=DOCUMENT)
    again = client.embeddings.with_raw_response.create(model=MODEL, input=DOCUMENT + "Twice.")
    worker = first.headers["x-radixmesh-worker"]
    assert again.headers["x-radixmesh-worker"] == worker
    assert int(again.headers["x-radixmesh-predicted-cached-tokens"]) > 0
    details = again.parse().usage.model_extra["prompt_tokens_details"]  # type: ignore[index]
    assert details["cached_tokens"] >= first.parse().usage.prompt_tokens - 4  # page of 4
    chat = client.completions.with_raw_response.create(
        model=MODEL, prompt=DOCUMENT, max_tokens=2, temperature=0
    )  # a generation of an embedded prompt reads the embedding's KV
    assert chat.headers["x-radixmesh-worker"] == worker
    usage = chat.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 4
    assert_no_leak(cluster)


def test_the_routers_grpc_service_embeds(client: openai.OpenAI, cluster: LocalCluster) -> None:
    over_http = client.embeddings.create(model=MODEL, input="over the wire", dimensions=16)
    with grpc.insecure_channel(cluster.target) as channel:
        stub = serving_pb2_grpc.ServingStub(channel)
        request = serving_pb2.GenerateRequest(
            text="over the wire", pooling=serving_pb2.PoolingParams(dimensions=16)
        )
        (message,) = list(stub.Generate(request, timeout=30))
    assert message.finished and not message.token_ids and message.prompt_tokens > 0
    assert np.allclose(list(message.embedding), over_http.data[0].embedding, atol=1e-6)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": ["fine", ""]}, "input[1]", "is empty"),
        ({"input": []}, "input", "is empty"),
        ({"input": [[5, 10**6]]}, "input", "outside the vocabulary"),
        ({"input": "x", "dimensions": 0}, "dimensions", "out of range"),
        ({"input": "x", "dimensions": 10**6}, "dimensions", "embeddings have 64 values"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "float"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "at least 1"),
        ({"input": ["x"] * 2049}, "input", "send 1 to 2048"),
        ({"input": list(range(3, 600))}, "input", "maximum context length is 512"),
        ({"input": "x", "priority": 1}, "priority", "fcfs"),
    ],
)
def test_a_bad_request_is_refused_naming_its_field_and_leaves_nothing_behind(
    cluster: LocalCluster, body: dict[str, object], param: str, words: str
) -> None:
    reply = httpx.post(f"{cluster.http_url}/v1/embeddings", json={"model": MODEL} | body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    too_long = "maximum context length" in words
    assert (error["code"] == "context_length_exceeded") == too_long, error
    assert_no_leak(cluster)
    ok = httpx.post(f"{cluster.http_url}/v1/embeddings", json={"model": MODEL, "input": "ok"})
    assert ok.status_code == 200, ok.text


def test_a_client_that_goes_away_cancels_the_inputs_left(cluster: LocalCluster) -> None:
    inputs = [[3 + (i * 7 + j) % 250 for j in range(200)] for i in range(2048)]
    served_before = sum(e.stats().requests_finished for e in cluster.engines.values())
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{cluster.http_url}/v1/embeddings",
            json={"model": MODEL, "input": inputs},
            timeout=httpx.Timeout(30, read=1.0),
        )
    left = time.monotonic()
    while cluster.service.in_flight and time.monotonic() - left < 10.0:
        time.sleep(0.02)
    assert not cluster.service.in_flight, "inputs outlived their client"
    assert_no_leak(cluster)
    served = sum(e.stats().requests_finished for e in cluster.engines.values()) - served_before
    assert served < len(inputs), "every input was embedded for a client that had gone"


def test_a_burst_of_inputs_waits_its_turn_within_the_routers_in_flight_limit(
    tiny: LoadedModel,
) -> None:
    """router.max_in_flight 4: two inputs at a time, all requests together, so 40 inputs (and
    a chat beside them) are served, none refused as over the limit."""
    small = start_cluster(tiny, http=True, router=RouterSection(port=0, max_in_flight=4))
    try:
        body = {"model": MODEL, "input": [[3 + i, 4, 5, 6, 7] for i in range(40)]}
        url = f"{small.http_url}/v1"
        with httpx.Client(timeout=60) as http, ThreadPoolExecutor(2) as pool:
            burst = pool.submit(http.post, f"{url}/embeddings", json=body)
            time.sleep(0.05)  # the burst under way
            chat = http.post(f"{url}/completions", json={"model": MODEL, "prompt": "hi"})
            embedded = burst.result()
        assert embedded.status_code == 200, embedded.text
        assert len(embedded.json()["data"]) == 40
        assert chat.status_code == 200, chat.text
        assert_no_leak(small)
    finally:
        small.close()


def test_an_embedded_chat_is_not_answered_unless_asked(cluster: LocalCluster) -> None:
    """vLLM's default for a chat embedding: no generation prompt after the last message."""
    chat = serving_pb2.ChatMessages(messages=[serving_pb2.ChatMessage(role="user", content="hi")])
    with grpc.insecure_channel(cluster.target) as channel:
        stub = serving_pb2_grpc.ServingStub(channel)
        lengths = []
        for answered in (None, False, True):
            request = serving_pb2.GenerateRequest(chat=chat, pooling=serving_pb2.PoolingParams())
            if answered is not None:
                request.add_generation_prompt = answered
            (message,) = list(stub.Generate(request, timeout=30))
            lengths.append(message.prompt_tokens)
    assert lengths[0] == lengths[1] < lengths[2]


def test_a_worker_dying_under_a_batch_is_invisible_to_its_client(tiny: LoadedModel) -> None:
    """A fault: one of two workers is killed (its server stopped with no grace) while a
    request's inputs run. Its inputs are retried on the other, and the client gets every
    embedding as an undisturbed run gives it."""
    cluster = start_cluster(tiny, http=True)
    try:
        url = f"{cluster.http_url}/v1/embeddings"
        inputs = [[3 + (i * 11 + j) % 250 for j in range(120)] for i in range(300)]
        body = {"model": MODEL, "input": inputs, "encoding_format": "float"}
        undisturbed = httpx.post(url, json=body, timeout=120)
        assert undisturbed.status_code == 200, undisturbed.text
        fresh = {"X-Radixmesh-Tenant": "another"}  # nothing cached for it: all computed again
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, url, json=body, headers=fresh, timeout=120)
            while len(cluster.service.in_flight) < 8:  # inputs on both workers by now
                time.sleep(0.002)
            cluster.kill_worker("worker-0")
            disturbed = answer.result()
        assert disturbed.status_code == 200, disturbed.text
        assert cluster.service.counters.retried > 0, "the kill met no input in flight"
        for before, after in zip(undisturbed.json()["data"], disturbed.json()["data"], strict=True):
            assert np.allclose(before["embedding"], after["embedding"], atol=1e-5)
        assert_no_leak(cluster)
    finally:
        cluster.close()


def test_an_input_refused_for_load_pauses_longer_each_time_and_then_gives_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pauses = list(itertools.islice(embeddings.overload_pauses(), 8))
    bases = [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert all(base <= p <= 1.25 * base for p, base in zip(pauses, bases, strict=True)), pauses
    monkeypatch.setattr(embeddings, "OVERLOAD_WAIT_S", 0.0)
    assert list(embeddings.overload_pauses()) == []
