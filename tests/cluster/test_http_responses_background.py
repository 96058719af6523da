"""Background responses on the Responses API (`background: true`), driven by the `openai` SDK
over real HTTP on loopback against a local cluster of two tiny-model workers: answered at once,
queued, and polled to the answer a foreground request gets; cancelled mid-generation with the
worker's pages freed; a refused request ending `failed`, naming the field; and what is refused
outright."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import openai
import pytest

from tests.cluster.local_cluster import SERVED_NAME, LocalCluster
from tests.cluster.tool_fixtures import openai_client, served
from worker.loader import LoadedModel

MODEL = SERVED_NAME
GREEDY: dict[str, Any] = {"model": MODEL, "max_output_tokens": 8, "temperature": 0}
LONG: dict[str, Any] = {**GREEDY, "input": "Tell a long story.", "max_output_tokens": 700}


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(tiny)


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    yield from openai_client(cluster)


def polled(client: openai.OpenAI, response_id: str, until: tuple[str, ...]) -> Any:
    """The response once its status is one of `until` (a bounded wait)."""
    deadline = time.monotonic() + 60
    while True:
        response = client.responses.retrieve(response_id)
        if response.status in until or time.monotonic() > deadline:
            return response
        time.sleep(0.02)


def test_a_background_response_is_polled_to_the_foreground_answer(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    queued = client.responses.create(input="Name a colour.", background=True, **GREEDY)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    ended = polled(client, queued.id, ("completed", "incomplete", "failed"))
    foreground = client.responses.create(input="Name a colour.", store=False, **GREEDY)
    assert ended.status == foreground.status and ended.background is True
    assert ended.output_text == foreground.output_text and ended.output_text
    assert ended.usage.output_tokens == foreground.usage.output_tokens  # type: ignore[union-attr]
    follow = client.responses.create(input="Another?", previous_response_id=queued.id, **GREEDY)
    assert follow.status in ("completed", "incomplete")
    cluster.wait_idle()


def test_cancel_stops_the_generation_and_frees_its_pages(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    queued = client.responses.create(background=True, **LONG)
    polled(client, queued.id, ("in_progress",))
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.background is True
    assert cancelled.usage is not None and 0 < cancelled.usage.output_tokens < 700
    cluster.wait_idle()  # the worker's call closed: no request, no private page left
    assert not cluster.service.in_flight
    kept = client.responses.retrieve(queued.id)
    assert kept.model_dump() == cancelled.model_dump()
    assert client.responses.cancel(queued.id).status == "cancelled"  # again: as it is


def test_a_router_that_stops_cancels_its_background_generations(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    queued = client.responses.create(background=True, **LONG)
    polled(client, queued.id, ("in_progress",))
    assert cluster.http is not None
    background = cluster.http.api.background
    assert len(background) == 1
    cluster.loop.run(background.close())
    assert len(background) == 0
    assert client.responses.retrieve(queued.id).status == "cancelled"
    cluster.wait_idle()


def test_only_a_background_response_is_cancelled(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    foreground = client.responses.create(input="Hi.", **GREEDY)
    with pytest.raises(openai.BadRequestError, match="is not a background response"):
        client.responses.cancel(foreground.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_never")
    cluster.wait_idle()


def test_a_refused_background_request_ends_failed_naming_the_field(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    queued = client.responses.create(
        background=True, instructions="Be brief.", input=[{"role": "user", "content": "x" * 3000}],
        **GREEDY,
    )  # fmt: skip
    assert queued.status == "queued"
    ended = polled(client, queued.id, ("failed",))
    assert ended.status == "failed" and ended.error is not None
    assert ended.error.message.startswith("input: ") and ended.error.code == "invalid_prompt"
    assert "maximum context length" in ended.error.message
    cluster.wait_idle()


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"stream": True}, "send stream: false"),
        ({"store": False}, "leave store true"),
        ({"background": "yes"}, "boolean"),
    ],
)
def test_background_refusals_name_it(
    cluster: LocalCluster, change: dict[str, Any], words: str
) -> None:
    body = {**GREEDY, "input": "Hi.", "background": True} | change
    answer = httpx.post(f"{cluster.http_url}/v1/responses", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "background" and words in answer.text
    assert cluster.http is not None and len(cluster.http.api.background) == 0
