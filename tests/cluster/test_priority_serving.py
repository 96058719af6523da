"""A request's priority through the router to its worker (engine.scheduling_policy), driven by
the `openai` SDK over real HTTP and by radixmesh's gRPC client, on local clusters of one
tiny-model worker: under "priority" a high-priority request preempts a long low-priority one
that holds the worker's only running slot, and the low one still streams exactly its answer;
under "fcfs" a priority other than 0 is refused by name, on both faces."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import grpc
import httpx2 as httpx
import openai
import pytest

from cluster.client import Client, text_request
from cluster.config import RouterSection
from cluster.requests import prepare
from cluster.stream_progress import StreamProgress
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster, start_cluster
from worker.error_details import refusal_of
from worker.errors import InvalidRequest
from worker.loader import LoadedModel
from worker.validation import RequestLimits

PRIORITY = replace(ENGINE, scheduling_policy="priority", max_running=1)
LONG: dict[str, Any] = {
    "model": SERVED_NAME,
    "messages": [{"role": "user", "content": "Tell a long story."}],
    "max_tokens": 400,
    "temperature": 0,
    "extra_body": {"ignore_eos": True, "priority": 5},
}


@pytest.fixture(scope="module")
def by_priority(tiny: LoadedModel) -> Iterator[LocalCluster]:
    cluster = start_cluster(tiny, workers=1, engine=PRIORITY, http=True)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def fcfs(tiny: LoadedModel) -> Iterator[LocalCluster]:
    cluster = start_cluster(tiny, workers=1, http=True)
    yield cluster
    cluster.close()


def test_a_high_priority_request_is_served_while_a_long_low_one_waits_then_resumes(
    by_priority: LocalCluster,
) -> None:
    (engine,) = by_priority.engines.values()
    with openai.OpenAI(
        base_url=f"{by_priority.http_url}/v1", api_key="none", max_retries=0
    ) as client:
        alone = client.chat.completions.create(**LONG)
        before = engine.stats().preemptions
        stream = client.chat.completions.create(stream=True, **LONG)
        pieces = []
        for chunk in stream:  # the low one is generating: it holds the only running slot
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                break
        # hold the engine between two steps until the high one has reached it, so that the
        # low one is surely still running when it is scheduled, however fast this machine is
        gate = threading.Event()
        engine.call(lambda: gate.wait(60))
        with ThreadPoolExecutor(1) as pool:
            asked = pool.submit(
                client.chat.completions.create,
                model=SERVED_NAME,
                messages=[{"role": "user", "content": "Name a colour."}],
                max_tokens=8,
                temperature=0,
                extra_body={"priority": -1},
                extra_headers={"X-Request-Id": "high-1"},
            )
            deadline = time.monotonic() + 30
            running = lambda: any(i.startswith("high-1@") for i in engine._active_ids)  # noqa: E731
            while not running() and time.monotonic() < deadline:
                time.sleep(0.005)
            gate.set()
            high = asked.result(timeout=60)
        assert high.choices[0].finish_reason in ("stop", "length")
        assert engine.stats().preemptions == before + 1  # the low one made room for it
        finish = None
        for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
    # preempted and resumed, mostly from the cache: the client sees nothing of it
    assert finish == "length"
    assert "".join(pieces) == alone.choices[0].message.content
    by_priority.wait_idle()


def test_priority_is_taken_on_completions_responses_and_grpc(by_priority: LocalCluster) -> None:
    with openai.OpenAI(
        base_url=f"{by_priority.http_url}/v1", api_key="none", max_retries=0
    ) as client:
        text = client.completions.create(
            model=SERVED_NAME,
            prompt="Hi",
            max_tokens=4,
            extra_body={"priority": 3, "ignore_eos": True},  # 4 tokens, sampled or not
        )
        assert text.usage is not None and text.usage.completion_tokens == 4
        answer = client.responses.create(
            model=SERVED_NAME, input="Hi", max_output_tokens=4, extra_body={"priority": -7}
        )
        assert answer.status in ("completed", "incomplete")
    request = text_request("Hi", max_tokens=4, priority=2**31 - 1)
    streamed = list(Client(by_priority.target).generate(request, timeout=60))
    assert streamed[-1].finished and sum(len(r.token_ids) for r in streamed) == 4


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/responses", {"input": "Hi"}),
    ],
)
def test_a_priority_is_refused_by_name_under_fcfs_and_zero_asks_nothing(
    fcfs: LocalCluster, path: str, body: dict[str, Any]
) -> None:
    url = f"{fcfs.http_url}{path}"
    refused = httpx.post(url, json={"model": SERVED_NAME, **body, "priority": -1}, timeout=60)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "priority"
    assert "scheduling_policy" in error["message"] and "fcfs" in error["message"]
    zero = httpx.post(url, json={"model": SERVED_NAME, **body, "priority": 0}, timeout=60)
    assert zero.status_code == 200, zero.text


@pytest.mark.parametrize(("value", "why"), [(2**31, "out of range"), (True, "integer")])
def test_a_priority_that_is_no_int32_is_refused_by_name(
    by_priority: LocalCluster, value: object, why: str
) -> None:
    body = {"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 2, "priority": value}
    refused = httpx.post(f"{by_priority.http_url}/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "priority" and why in error["message"]


def test_grpc_refuses_a_priority_under_fcfs_with_the_field(fcfs: LocalCluster) -> None:
    request = text_request("Hi", max_tokens=4, priority=1)
    with pytest.raises(grpc.RpcError) as err:
        list(Client(fcfs.target).generate(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refusal_of(err.value)[0] == "priority"
    assert "scheduling_policy" in (err.value.details() or "")


def test_a_priority_goes_with_every_call_a_request_makes_resumed_ones_included() -> None:
    limits = RequestLimits(vocab_size=100, max_model_len=256, priorities=True)
    prepared = prepare(
        text_request(token_ids=[1, 2, 3], n=2, temperature=1, priority=-3), None, limits
    )
    progress = StreamProgress(prepared)
    (first,) = progress.worker_requests(0)
    assert first.priority == -3
    progress.record(serving_pb2.GenerateResponse(index=0, token_ids=[5]))  # then its worker dies
    resumed = progress.worker_requests(0)
    assert [call.resume.sample_index for call in resumed] == [0, 1]
    assert [call.priority for call in resumed] == [-3, -3]
    fcfs = replace(limits, priorities=False)
    with pytest.raises(InvalidRequest) as refused:  # before any tokenising
        prepare(text_request("a text never tokenised", priority=1), Untouchable(), fcfs)
    assert refused.value.field == "priority"


class Untouchable:
    """A tokenizer that fails the test if it is asked anything."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("a refused priority must be refused before any tokenising")

    def apply_chat_template(self, messages: list[dict[str, object]]) -> str:
        raise AssertionError("a refused priority must be refused before any tokenising")


def test_the_routers_in_flight_limit_counts_only_what_is_as_urgent(tiny: LoadedModel) -> None:
    router = RouterSection(port=0, max_in_flight=2)
    engine = replace(PRIORITY, max_running=4)  # the long streams all run at once
    cluster = start_cluster(tiny, workers=1, engine=engine, router=router)
    client = Client(cluster.target)

    def long(text: str, priority: int) -> serving_pb2.GenerateRequest:
        request = text_request(text, max_tokens=400, priority=priority)
        request.sampling.ignore_eos = True  # in flight for all 400 tokens
        return request

    def refused(priority: int) -> str:
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(text_request("Hi", max_tokens=2, priority=priority), timeout=60))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return err.value.details() or ""

    try:
        held = []
        for priority in (5, 5, -1, -1):  # each pair fills the limit at its own priority
            if priority == -1:
                assert "at priority 5 or more urgent" in refused(5)
            call = client.generate(long(f"Story {len(held)}", priority))
            next(call)
            held.append(call)
        assert "2 requests in flight at priority -1 or more urgent" in refused(-1)
        # however urgent a call says it is, all together stay within twice the limit
        assert "4 requests in flight of every priority; the limit is 2 x 2" in refused(-9)
        for call in held:
            call.cancel()
        deadline = time.monotonic() + 10
        while cluster.service.priorities and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not cluster.service.priorities  # every call counted is uncounted as it ends
        urgent = list(client.generate(text_request("Hi", max_tokens=2, priority=-1), timeout=60))
        assert urgent[-1].finished
    finally:
        client.close()
        cluster.close()
