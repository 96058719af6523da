"""Request migration over real gRPC: a worker that dies mid-stream is invisible to its clients.

Each request is first run alone and undisturbed; then the same requests run together, a worker
serving them is killed (its server stopped with no grace, its engine stopped) or detached, and
every client must receive exactly the undisturbed stream: the same tokens, the same text, the
same finish reason, for greedy, seeded and n > 1 sampling and across a stop string.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from cluster.client import Client, text_request
from cluster.config import RouterSection
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import LocalCluster, start_cluster
from worker.loader import LoadedModel

SYSTEM = "A worker may die at any moment; the router moves its streams elsewhere. "


def request(
    text: str,
    *,
    max_tokens: int = 300,
    temperature: float = 0.0,
    seed: int | None = None,
    n: int = 1,
    stop: tuple[str, ...] = (),
) -> serving_pb2.GenerateRequest:
    message = text_request(
        SYSTEM + text, max_tokens=max_tokens, temperature=temperature, seed=seed, n=n
    )
    message.sampling.ignore_eos = True
    message.sampling.stop.extend(stop)
    return message


@dataclass
class Stream:
    """A request streamed on a thread of its own: the messages it got, or its error."""

    messages: list[serving_pb2.GenerateResponse] = field(default_factory=list)
    error: grpc.RpcError | None = None
    thread: threading.Thread | None = None

    def seen(self, index: int = 0) -> tuple[list[int], str, str]:
        """What the client has of sample `index`: tokens, text, finish reason."""
        mine = [m for m in self.messages if m.index == index]
        tokens = [t for m in mine for t in m.token_ids]
        return tokens, "".join(m.text for m in mine), mine[-1].finish_reason if mine else ""


def stream(client: Client, message: serving_pb2.GenerateRequest) -> Stream:
    run = Stream()

    def read() -> None:
        try:
            for response in client.generate(message, timeout=60):
                run.messages.append(response)
        except grpc.RpcError as err:
            run.error = err

    run.thread = threading.Thread(target=read)
    run.thread.start()
    return run


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def finish(streams: list[Stream]) -> None:
    for run in streams:
        assert run.thread is not None
        run.thread.join(timeout=90)
        assert not run.thread.is_alive(), "a request hung"


def kill_the_busiest(cluster: LocalCluster, streams: list[Stream], messages: int) -> list[Stream]:
    """Once every stream has `messages` messages, kill the worker serving most of the unfinished
    ones and let every stream end; the streams it was serving at that message, each checked to
    have ended elsewhere."""
    wait_until(lambda: all(len(s.messages) >= messages for s in streams), "streams started", 60)
    serving = Counter(s.messages[-1].worker for s in streams if not s.messages[-1].finished)
    victim = serving.most_common(1)[0][0]
    cluster.kill_worker(victim)
    finish(streams)
    moved = [s for s in streams if s.messages[messages - 1].worker == victim]
    assert moved and all(s.messages[-1].worker != victim for s in moved)
    return moved


def undisturbed(cluster: LocalCluster, message: serving_pb2.GenerateRequest) -> Stream:
    run = stream(Client(cluster.target), message)
    finish([run])
    assert run.error is None, run.error
    return run


def test_streams_cut_by_a_dying_worker_continue_exactly(tiny: LoadedModel) -> None:
    cluster = start_cluster(tiny, workers=3)
    try:
        free = undisturbed(cluster, request("Stop somewhere late.", max_tokens=200))
        text = free.seen()[1]
        stop = text[int(len(text) * 0.8) :][:5]
        assert stop.strip(), f"pick a visible stop string from {text!r}"
        requests = [
            request("Greedy one."),
            request("Greedy two."),
            request("Seeded one.", temperature=0.8, seed=3),
            request("Seeded two.", temperature=1.0, seed=4),
            request("Three samples.", temperature=0.9, seed=5, n=3),
            request("Stop somewhere late.", max_tokens=200, stop=(stop,)),
        ]
        expected = [undisturbed(cluster, r) for r in requests]
        assert expected[-1].seen()[2] == "stop"
        client = Client(cluster.target)
        streams = [stream(client, r) for r in requests]
        moved = kill_the_busiest(cluster, streams, 8)

        for got, want, message in zip(streams, expected, requests, strict=True):
            assert got.error is None, got.error
            for index in range(message.sampling.n):
                assert got.seen(index) == want.seen(index), f"{message.text!r} sample {index}"
        assert cluster.service.counters.migrated >= len(moved) > 0
        assert cluster.stats().requests_migrated == cluster.service.counters.migrated
        cluster.wait_idle()
    finally:
        cluster.close()


def test_a_stream_on_a_worker_detached_under_it_moves_on(tiny: LoadedModel) -> None:
    """The router closes a worker's channel when it detaches it (another call failed there, or
    its KV feed): grpc.aio cancels the calls on it, which must read as that worker failing."""
    cluster = start_cluster(tiny, workers=2)
    try:
        message = request("Detached under me.", temperature=0.7, seed=9)
        expected = undisturbed(cluster, message)
        run = stream(Client(cluster.target), message)
        wait_until(lambda: len(run.messages) >= 5, "the stream started")
        first = run.messages[0].worker
        cluster.loop.run(cluster.links.detach(first))
        finish([run])
        assert run.error is None, run.error
        assert run.seen() == expected.seen()
        assert run.messages[-1].worker != first
        assert cluster.service.counters.migrated == 1
        cluster.wait_idle()  # the detached worker's engine ended the request too
    finally:
        cluster.close()


def test_with_no_worker_left_the_client_gets_one_clear_unavailable(tiny: LoadedModel) -> None:
    cluster = start_cluster(tiny, workers=1)
    try:
        run = stream(Client(cluster.target), request("Alone."))
        wait_until(lambda: len(run.messages) >= 5, "the stream started")
        cluster.kill_worker("worker-0")
        finish([run])
        assert run.error is not None
        assert run.error.code() == grpc.StatusCode.UNAVAILABLE
        assert "worker-0 failed mid-stream" in run.error.details()
        assert "no healthy worker" in run.error.details()
    finally:
        cluster.close()


def test_attempts_are_bounded_by_max_retries(tiny: LoadedModel) -> None:
    cluster = start_cluster(tiny, workers=2, router=RouterSection(port=0, max_retries=0))
    try:
        run = stream(Client(cluster.target), request("No second chance."))
        wait_until(lambda: len(run.messages) >= 5, "the stream started")
        cluster.kill_worker(run.messages[0].worker)
        finish([run])
        assert run.error is not None
        assert run.error.code() == grpc.StatusCode.UNAVAILABLE
        assert "0 other worker(s) were tried (router.max_retries)" in run.error.details()
        assert cluster.service.counters.migrated == 0
    finally:
        cluster.close()
