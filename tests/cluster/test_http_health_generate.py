"""SGLang's `GET /health_generate` over real HTTP on loopback against a local cluster of two
tiny-model workers: 200 once a one-token generation came back (naming its worker, to an
operator), without a token; 503 with the reason when the engines are wedged (their steps
blocked: no token in the probe's time), and while the router drains. A burst of probes is one
generation, and a failed start is the probe's reason (the probe alone, on made-up starts)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import grpc
import httpx2 as httpx
import pytest

from cluster.config import SecuritySection
from cluster.http.generation_probe import GenerationProbe, ProbeAnswer, ProbeFailed
from cluster.serving_call import ServingError
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster
from tests.cluster.test_http_sglang_generate import ended


def test_a_probe_generates_one_token(cluster: LocalCluster) -> None:
    """One generation routed and run, and left out of the request metrics (SGLang's probe
    sets log_metrics false): calls by status, latencies, the tenants' usage."""
    assert cluster.http is not None
    service = cluster.service
    routed, statuses = service.counters.routed, dict(service.counters.by_status)
    timed = ended(service)
    usage = {name: vars(u).copy() for name, u in service.tenants.tenants.items()}
    answer = httpx.get(f"{cluster.http_url}/health_generate", timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "ok"
    assert answer.json()["worker"] in cluster.engines
    assert service.counters.routed == routed + 1  # one generation ran
    assert service.counters.by_status == statuses
    assert {name: vars(u) for name, u in service.tenants.tenants.items()} == usage
    assert ended(service) == timed  # nor timed
    cluster.wait_idle()


def wedged(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every engine's step blocks (as a hung device would) until the event is set."""
    unblocked = threading.Event()
    for engine in cluster.engines.values():

        def step(original: Callable[[], bool] = engine.step) -> bool:
            unblocked.wait(30)
            return original()

        monkeypatch.setattr(engine, "step", step)
    return unblocked


def test_wedged_engines_fail_the_probe(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every engine's step blocks (as a hung device would): /health still says ok, the probe
    says no token came in its time; once the engines step again it is ok."""
    assert cluster.http is not None
    unblocked = wedged(cluster, monkeypatch)
    monkeypatch.setattr(cluster.http.api.probe, "timeout_s", 0.5)
    try:
        assert httpx.get(f"{cluster.http_url}/health", timeout=10).status_code == 200
        answer = httpx.get(f"{cluster.http_url}/health_generate", timeout=30)
        assert answer.status_code == 503, answer.text
        assert answer.json()["status"] == (
            "no token in 0.5 s, and no generation streamed since the probe began"
        )
    finally:
        unblocked.set()
    cluster.wait_idle()
    assert httpx.get(f"{cluster.http_url}/health_generate", timeout=30).status_code == 200
    cluster.wait_idle()


def test_only_an_operator_is_told_the_reason_and_the_worker(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probes carry no token, and the probe's reasons name workers and limits: with tokens
    set, a caller without an operator's token is told only ok, or that the generation failed."""
    assert cluster.http is not None
    api = cluster.http.api
    tokens = {"t-admin": "*", "t-acme": "acme"}
    security = SecuritySection(auth_tokens=tokens)
    monkeypatch.setattr(api, "config", replace(api.config, security=security))
    url = f"{cluster.http_url}/health_generate"

    def probe(token: str | None) -> httpx.Response:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return httpx.get(url, headers=headers, timeout=30)

    for token in (None, "t-acme", "t-unknown"):
        answer = probe(token)
        assert (answer.status_code, answer.json()) == (200, {"status": "ok"}), token
    assert probe("t-admin").json()["worker"] in cluster.engines
    unblocked = wedged(cluster, monkeypatch)
    monkeypatch.setattr(api.probe, "timeout_s", 0.5)
    try:
        hidden, told = probe("t-acme"), probe("t-admin")
    finally:
        unblocked.set()
    assert hidden.status_code == told.status_code == 503
    assert hidden.json() == {"status": "the probe's generation failed", "workers": 2}
    assert told.json()["status"].startswith("no token in 0.5 s")
    cluster.wait_idle()


def test_a_full_router_passes_while_a_stream_goes_on(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At router.max_in_flight (1 here) the probe's own generation is refused for load; the
    stream running meanwhile is the router's sign of life, as in SGLang."""
    monkeypatch.setattr(cluster.service, "config", replace(cluster.service.config, max_in_flight=1))
    body = {"model": SERVED_NAME, "prompt": "Count:", "max_tokens": 600, "ignore_eos": True}
    url = f"{cluster.http_url}/v1/completions"
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=60) as running:
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        answer = httpx.get(f"{cluster.http_url}/health_generate", timeout=30)
        rest = [line for line in lines if line.startswith("data: ")]
    assert answer.status_code == 200, answer.text
    assert "the limit is 1 (router.max_in_flight)" in answer.json()["busy"]
    assert rest[-1] == "data: [DONE]"  # the stream went on to its end
    cluster.wait_idle()


def test_a_draining_router_fails_the_probe_without_generating(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cluster.http is not None
    monkeypatch.setattr(cluster.http.api, "draining", True)
    before = dict(cluster.service.counters.by_status)
    answer = httpx.get(f"{cluster.http_url}/health_generate", timeout=10)
    assert answer.status_code == 503 and answer.json()["status"] == "draining"
    assert cluster.service.counters.by_status == before


def answering(gate: asyncio.Event, starts: list[str]) -> Callable[..., Any]:
    """A start that answers one token from worker "w" once `gate` is set, counting starts."""

    def start(message: serving_pb2.GenerateRequest) -> AsyncIterator[Any]:
        starts.append(message.request_id)

        async def stream() -> AsyncIterator[serving_pb2.GenerateResponse]:
            await gate.wait()
            yield serving_pb2.GenerateResponse(
                index=0, token_ids=[7], worker="w", finished=True, finish_reason="length"
            )

        return stream()

    return start


def test_a_burst_of_probes_is_one_generation() -> None:
    async def run() -> tuple[list[ProbeAnswer], list[str]]:
        gate, starts = asyncio.Event(), list[str]()
        probe = GenerationProbe(answering(gate, starts))
        waiting = [asyncio.ensure_future(probe.check()) for _ in range(5)]
        await asyncio.sleep(0.05)
        waiting[0].cancel()  # one probe goes away: the others still get the answer
        gate.set()
        answers = await asyncio.gather(*waiting[1:])
        await probe.check()  # the next probe, after: a generation of its own
        return answers, starts

    answers, starts = asyncio.run(run())
    assert answers == [ProbeAnswer("w")] * 4 and len(starts) == 2 and starts[0] != starts[1]
    assert all(s.startswith("health-generate-") for s in starts)


def test_a_refused_or_silent_generation_is_the_reason() -> None:
    def refused(message: serving_pb2.GenerateRequest) -> Any:
        raise ServingError(grpc.StatusCode.UNAVAILABLE, "no healthy worker")

    def silent(message: serving_pb2.GenerateRequest) -> Any:
        async def stream() -> AsyncIterator[serving_pb2.GenerateResponse]:
            yield serving_pb2.GenerateResponse(index=0, worker="w", finished=True)

        return stream()

    for start, reason in ((refused, "no healthy worker"), (silent, "without a token")):
        with pytest.raises(ProbeFailed, match=reason):
            asyncio.run(GenerationProbe(start).check())
    started = time.monotonic()
    never = asyncio.Event()
    with pytest.raises(ProbeFailed, match=r"no token in 0\.2 s, and no generation streamed"):
        asyncio.run(GenerationProbe(answering(never, []), timeout_s=0.2).check())
    assert time.monotonic() - started < 5


def full(message: serving_pb2.GenerateRequest) -> Any:
    raise ServingError(grpc.StatusCode.RESOURCE_EXHAUSTED, "64 requests in flight")


@pytest.mark.parametrize("own", ["refused", "slow"])
def test_a_busy_router_passes_while_others_stream(own: str) -> None:
    """The probe's own generation refused for load, or not answering in time: the probe
    passes once any generation streams after it began, and fails when none does."""
    clock = {"at": 0.0}

    async def run(streaming: bool) -> ProbeAnswer:
        async def others() -> None:
            while streaming:
                await asyncio.sleep(0.02)
                clock["at"] = time.monotonic()

        beside = asyncio.ensure_future(others())
        start = full if own == "refused" else answering(asyncio.Event(), [])
        try:
            return await GenerationProbe(start, lambda: clock["at"], timeout_s=0.3).check()
        finally:
            beside.cancel()

    answer = asyncio.run(run(streaming=True))
    assert answer.worker is None
    assert answer.busy == ("64 requests in flight" if own == "refused" else "no token in 0.3 s")
    with pytest.raises(ProbeFailed, match="no generation streamed since the probe began"):
        asyncio.run(run(streaming=False))
