"""The serving path over real gRPC on loopback: router -> workers -> engines, no Ray.

End to end with concurrency and shared prefixes, equivalence with the in-process engine, every
bad input of DESIGN section 9 (right status, the field named, server healthy, no page leaked),
cancellation, deadlines, a worker dying mid-load (its streams migrate: test_migration.py),
overload, and Abort from another connection.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.client import Client, text_request
from cluster.config import RouterSection
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import LocalCluster, start_cluster
from worker.engine import Engine, EngineConfig
from worker.error_details import refusal_of
from worker.errors import ContextOverflow
from worker.loader import LoadedModel
from worker.request import GenerateRequest
from worker.sampling_params import SamplingParams

SYSTEM = "The cache remembers what the model has already read. "


@pytest.fixture
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    running = start_cluster(tiny)
    yield running
    running.close()


def assert_no_leak(cluster: LocalCluster) -> None:
    cluster.wait_idle()
    stats = cluster.stats()
    assert all(w.healthy and w.private_pages == 0 for w in stats.workers), stats.workers
    assert stats.requests_in_flight == 0


def collect(client: Client, request: serving_pb2.GenerateRequest, timeout: float = 30) -> list:
    return list(client.generate(request, timeout=timeout))


def test_concurrent_streams_with_shared_prefixes_match_the_engine(
    cluster: LocalCluster, tiny: LoadedModel
) -> None:
    questions = [f"Question {i}: what did the router do?" for i in range(12)]
    requests = [
        text_request(SYSTEM + q, max_tokens=10, temperature=0.8, seed=i, request_id=f"r{i}")
        for i, q in enumerate(questions)
    ]
    client = Client(cluster.target)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        streams = list(pool.map(lambda r: collect(client, r), requests))
    reference = Engine(tiny.model, tiny.tokenizer, EngineConfig(num_pages=256, page_size=4))
    for request, stream in zip(requests, streams, strict=True):
        assert stream[-1].finished and stream[-1].finish_reason == "length"
        outputs: list = []
        sampling = SamplingParams(max_tokens=10, temperature=0.8, seed=request.sampling.seed)
        reference.submit(
            GenerateRequest("x", prompt=request.text, sampling=sampling), outputs.append
        )
        while reference.step():
            pass
        assert [t for m in stream for t in m.token_ids] == [t for o in outputs for t in o.token_ids]
        assert "".join(m.text for m in stream) == "".join(o.text for o in outputs)
    assert_no_leak(cluster)


def test_a_repeated_prefix_lands_on_the_same_worker_and_hits(cluster: LocalCluster) -> None:
    client = Client(cluster.target)
    long_prompt = SYSTEM * 4
    first = collect(client, text_request(long_prompt + "First?", max_tokens=4))[-1]
    second = collect(client, text_request(long_prompt + "Second?", max_tokens=4))[-1]
    assert first.cached_prompt_tokens == 0
    assert second.worker == first.worker
    assert second.cached_prompt_tokens >= 32
    assert second.predicted_cached_tokens > 0
    stats = cluster.stats()
    assert stats.actual_cached_tokens >= second.cached_prompt_tokens
    assert_no_leak(cluster)


def _bad(**fields: object) -> serving_pb2.GenerateRequest:
    request = text_request("hello there", max_tokens=4)
    for name, value in fields.items():
        if name == "sampling":
            request.sampling.MergeFrom(value)  # type: ignore[arg-type]
        elif name == "token_ids":
            request.token_ids.ids[:] = value  # type: ignore[index]
        elif name == "adapter":
            request.namespace.adapter = value  # type: ignore[assignment]
        elif name == "images":
            request.images.append(value)  # type: ignore[arg-type]
        elif name == "clear_prompt":
            request.ClearField("prompt")
        else:
            setattr(request, name, value)
    return request


OVERFLOW = ContextOverflow.reason
BAD = [
    (_bad(text=""), "prompt: is empty", None),
    (_bad(token_ids=[]), "prompt: is empty", None),
    (_bad(text="word " * 600), "This model's maximum context length is 512 tokens", OVERFLOW),
    (_bad(token_ids=[1, 2, 10**6]), "prompt_token_ids: token 1000000", None),
    (_bad(token_ids=[1, -5]), "prompt_token_ids: token -5", None),
    (_bad(adapter="sql-lora"), "namespace.adapter: unknown adapter 'sql-lora'", None),
    (_bad(sampling=serving_pb2.SamplingParams(temperature=-1)), "temperature: must be >= 0", None),
    (
        _bad(sampling=serving_pb2.SamplingParams(temperature=float("inf"))),
        "and finite, got inf",
        None,
    ),
    (_bad(sampling=serving_pb2.SamplingParams(top_p=0)), "top_p", None),
    (_bad(sampling=serving_pb2.SamplingParams(top_p=1.5)), "top_p", None),
    (_bad(sampling=serving_pb2.SamplingParams(max_tokens=0)), "max_tokens: must be in", None),
    (
        _bad(sampling=serving_pb2.SamplingParams(max_tokens=10**9)),
        "max_tokens: This model's maximum context length is 512 tokens. However, you requested",
        OVERFLOW,
    ),
    (_bad(sampling=serving_pb2.SamplingParams(n=0)), "n: must be in", None),
    (_bad(sampling=serving_pb2.SamplingParams(stop_token_ids=[-3])), "stop_token_ids", None),
    (_bad(images=b"\x89PNG garbage"), "images: this model has no vision encoder", None),
    (_bad(clear_prompt=True), "prompt: set one of text, token_ids or chat", None),
    (_bad(request_id="no spaces allowed"), "request_id", None),
]


@pytest.mark.parametrize(("request_", "words", "reason"), BAD, ids=[w[:24] for _, w, _ in BAD])
def test_bad_input_is_invalid_argument_naming_the_field(
    cluster: LocalCluster, request_: serving_pb2.GenerateRequest, words: str, reason: str | None
) -> None:
    """The field and, for a prompt that overflows the context, the reason travel in the call's
    rich status too (google.rpc BadRequest and ErrorInfo), for programs to read."""
    client = Client(cluster.target)
    with pytest.raises(grpc.RpcError) as err:
        collect(client, request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()
    field = err.value.details().partition(":")[0]
    assert refusal_of(err.value) == (field, reason)
    assert collect(client, text_request("still serving?", max_tokens=3))[-1].finished
    assert_no_leak(cluster)


def test_health_and_reflection_are_served(cluster: LocalCluster) -> None:
    with grpc.insecure_channel(cluster.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "radixmesh.v1.Serving"):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_client_cancel_mid_stream_frees_the_sequence(cluster: LocalCluster) -> None:
    client = Client(cluster.target)
    stream = client.generate(text_request(SYSTEM, max_tokens=400, request_id="cancel-me"))
    next(stream)
    next(stream)
    stream.cancel()  # type: ignore[attr-defined]
    assert_no_leak(cluster)
    assert sum(w.requests_finished for w in cluster.stats().workers) == 1


def test_deadline_exceeded_frees_the_sequence(cluster: LocalCluster) -> None:
    client = Client(cluster.target)
    with pytest.raises(grpc.RpcError) as err:
        collect(client, text_request(SYSTEM, max_tokens=450), timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_no_leak(cluster)


def test_abort_from_another_connection_ends_the_stream(cluster: LocalCluster) -> None:
    client, other = Client(cluster.target), Client(cluster.target)
    stream = client.generate(text_request(SYSTEM, max_tokens=400, request_id="abort-me"))
    next(stream)
    assert other.abort("abort-me") is True
    assert other.abort("never-existed") is False
    rest = list(stream)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert_no_leak(cluster)


def test_a_worker_dying_mid_load_loses_no_request(tiny: LoadedModel) -> None:
    """Every stream completes: those on the dead worker move to the others (test_migration.py
    checks they continue exactly)."""
    cluster = start_cluster(tiny, workers=3)
    try:
        client = Client(cluster.target)
        results: dict[int, object] = {}

        def run(i: int) -> None:
            try:
                stream = collect(client, text_request(f"{i} " + SYSTEM, max_tokens=120), 60)
                results[i] = stream[-1].finish_reason
            except grpc.RpcError as err:
                results[i] = err.code()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(9)]
        for thread in threads:
            thread.start()
        time.sleep(0.8)
        victim = next(iter(cluster.engines))
        cluster.kill_worker(victim)
        for thread in threads:
            thread.join(timeout=90)
        assert not any(thread.is_alive() for thread in threads), "a request hung"
        assert set(results) == set(range(9))
        assert set(results.values()) == {"length"}, results
        assert victim not in cluster.links.links
        after = collect(client, text_request("served by the others", max_tokens=5))[-1]
        assert after.finished and after.worker != victim
        cluster.wait_idle()
    finally:
        cluster.close()


def test_a_worker_that_fails_before_the_first_token_is_retried(tiny: LoadedModel) -> None:
    cluster = start_cluster(tiny, workers=2)
    try:
        client = Client(cluster.target)
        prompt = SYSTEM * 3 + "who answers?"
        warm = collect(client, text_request(prompt, max_tokens=2))[-1]
        # Its engine stops but its server stays up: the router still routes the prefix there,
        # gets UNAVAILABLE before any token, detaches the worker and retries on the other.
        cluster.engines[warm.worker].stop()
        answer = collect(client, text_request(prompt, max_tokens=3))[-1]
        assert answer.finished and answer.worker != warm.worker
        assert cluster.service.counters.retried == 1
        assert warm.worker not in cluster.links.links
    finally:
        cluster.close()


def test_overload_is_refused_quickly_and_the_rest_complete(tiny: LoadedModel) -> None:
    cluster = start_cluster(tiny, router=RouterSection(port=0, max_in_flight=3))
    try:
        client = Client(cluster.target)
        codes: list[object] = []
        refusal_seconds: list[float] = []
        lock = threading.Lock()

        def run(i: int) -> None:
            began = time.monotonic()
            try:
                collect(client, text_request(f"{i} " + SYSTEM, max_tokens=60), 60)
                outcome: object = "ok"
            except grpc.RpcError as err:
                outcome = err.code()
                with lock:  # asserted below: an assert in a thread would not fail the test
                    refusal_seconds.append(time.monotonic() - began)
            with lock:
                codes.append(outcome)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(10)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert len(codes) == 10, codes
        assert refusal_seconds and max(refusal_seconds) < 2, "refusal must be quick"
        assert codes.count("ok") >= 3
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
        assert set(codes) <= {"ok", grpc.StatusCode.RESOURCE_EXHAUSTED}
        cluster.wait_idle()
    finally:
        cluster.close()


class GatedTokenizer:
    """The router's real tokenizer, held at a gate: the test decides when encoding may end, and
    sees how many requests are inside it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.gate = threading.Event()
        self.inside = 0
        self.lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self.lock:
            self.inside += 1
        self.gate.wait(timeout=30)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        return str(self.tokenizer.apply_chat_template(messages))


def test_requests_being_tokenised_count_against_the_in_flight_limit(tiny: LoadedModel) -> None:
    """Tokenising happens on a thread, while other calls come in: those must already count."""
    cluster = start_cluster(tiny, router=RouterSection(port=0, max_in_flight=3))
    gated = GatedTokenizer(cluster.links.tokenizer)
    cluster.links.tokenizer = gated  # type: ignore[assignment]
    try:
        client = Client(cluster.target)
        codes: list[object] = []

        def run(i: int) -> None:
            try:
                collect(client, text_request(f"{i} " + SYSTEM, max_tokens=4), 60)
                codes.append("ok")
            except grpc.RpcError as err:
                codes.append(err.code())

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        while gated.inside < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gated.inside == 3
        late = [threading.Thread(target=run, args=(i,)) for i in range(3, 6)]
        for thread in late:
            thread.start()
        for thread in late:
            thread.join(timeout=20)
        assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3 and gated.inside == 3
        gated.gate.set()
        for thread in threads:
            thread.join(timeout=60)
        assert codes[3:] == ["ok"] * 3
        cluster.wait_idle()
    finally:
        gated.gate.set()
        cluster.close()


def test_no_healthy_worker_is_unavailable(tiny: LoadedModel) -> None:
    cluster = start_cluster(tiny, workers=1)
    try:
        cluster.kill_worker("worker-0")
        cluster.loop.run(cluster.links.detach("worker-0"))
        with pytest.raises(grpc.RpcError) as err:
            collect(Client(cluster.target), text_request("anyone?", max_tokens=2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        cluster.close()


def test_tls_and_missing_paths_are_explained(tmp_path: Path) -> None:
    from cluster.config import ClusterConfig, ConfigError

    bad = tmp_path / "c.yaml"
    bad.write_text("security: {auth_tokens: {t: 1}}\n")
    with pytest.raises(ConfigError, match=r"security\.auth_tokens"):
        ClusterConfig.load(bad)


def test_admin_switches_policy_and_clears_caches(cluster: LocalCluster) -> None:
    from protos.radixmesh.v1 import serving_pb2_grpc

    client = Client(cluster.target)
    collect(client, text_request(SYSTEM * 3, max_tokens=2))
    with grpc.insecure_channel(cluster.target) as channel:
        admin = serving_pb2_grpc.AdminStub(channel)
        answer = admin.SetPolicy(serving_pb2.SetPolicyRequest(policy="round_robin"), timeout=10)
        assert answer.previous == "cache_aware"
        assert client.stats().policy == "round_robin"
        with pytest.raises(grpc.RpcError) as err:
            admin.SetPolicy(serving_pb2.SetPolicyRequest(policy="fastest"), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "fastest" in err.value.details()
        cluster.wait_idle()
        assert client.stats().text_index.chars > 0
        freed = admin.ClearCaches(serving_pb2.ClearCachesRequest(), timeout=10).pages_freed
        assert freed > 0
    assert all(w.cached_pages == 0 for w in client.stats().workers)
    assert client.stats().text_index.chars == 0  # the router's text index is emptied too
    assert client.stats().vocab_size == 512 and client.stats().max_model_len == 512
    cold = collect(client, text_request(SYSTEM * 3, max_tokens=2))[-1]
    assert cold.cached_prompt_tokens == 0
