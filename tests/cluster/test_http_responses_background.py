"""Background responses on the Responses API (`background: true`), driven by the `openai` SDK
over real HTTP on loopback against a local cluster of two tiny-model workers: answered at once,
queued, and polled to the answer a foreground request gets; cancelled mid-generation with the
worker's pages freed; a refused request ending `failed`, naming the field; and what is refused
outright."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx2 as httpx
import openai
import pytest

from cluster.http import responses_output, responses_stream
from cluster.http.event_log import EventLog
from cluster.http.responses_background import BackgroundResponses
from cluster.http.responses_schema import ResponsesRequest
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster

MODEL = SERVED_NAME
GREEDY: dict[str, Any] = {"model": MODEL, "max_output_tokens": 8, "temperature": 0}
LONG: dict[str, Any] = {**GREEDY, "input": "Tell a long story.", "max_output_tokens": 960}
"""About 1.5 s of generation here: the tests that stop one mid-way have a second to do it."""


ENDED = ("completed", "incomplete", "failed", "cancelled")


def polled(client: openai.OpenAI, response_id: str, until: tuple[str, ...]) -> Any:
    """The response once its status is one of `until`, or it ended (a bounded wait)."""
    deadline = time.monotonic() + 60
    while True:
        response = client.responses.retrieve(response_id)
        if response.status in (*until, *ENDED) or time.monotonic() > deadline:
            return response
        time.sleep(0.01)


def running(client: openai.OpenAI) -> Any:
    """A long background response, once it is generating."""
    queued = client.responses.create(background=True, **LONG)
    assert polled(client, queued.id, ("in_progress",)).status == "in_progress"
    return queued


def test_a_background_response_is_polled_to_the_foreground_answer(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    queued = client.responses.create(input="Name a colour.", background=True, **GREEDY)
    queued_items = httpx.get(f"{cluster.http_url}/v1/responses/{queued.id}/input_items").json()
    queued_items = queued_items["data"]
    assert queued.status == "queued" and queued.background is True and queued.output == []
    ended = polled(client, queued.id, ENDED)
    foreground = client.responses.create(input="Name a colour.", store=False, **GREEDY)
    assert ended.status == foreground.status and ended.background is True
    listed = [item.id for item in client.responses.input_items.list(queued.id)]
    assert listed == [item["id"] for item in queued_items]  # the same ids, queued or ended
    assert ended.output_text == foreground.output_text and ended.output_text
    assert ended.usage.output_tokens == foreground.usage.output_tokens  # type: ignore[union-attr]
    follow = client.responses.create(input="Another?", previous_response_id=queued.id, **GREEDY)
    assert follow.status in ("completed", "incomplete")
    cluster.wait_idle()


def test_cancel_stops_the_generation_and_frees_its_pages(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    queued = running(client)
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.background is True
    assert cancelled.usage is not None and cancelled.usage.output_tokens < 960
    cluster.wait_idle()  # the worker's call closed: no request, no private page left
    assert not cluster.service.in_flight
    kept = client.responses.retrieve(queued.id)
    assert kept.model_dump() == cancelled.model_dump()
    assert client.responses.cancel(queued.id).status == "cancelled"  # again: as it is


def test_a_router_that_stops_cancels_its_background_generations(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    queued = running(client)
    assert cluster.http is not None
    background = cluster.http.api.background
    assert len(background) == 1
    cluster.loop.run(background.close())
    assert len(background) == 0
    assert client.responses.retrieve(queued.id).status == "cancelled"
    with pytest.raises(openai.InternalServerError, match="stopping"):
        client.responses.create(background=True, **LONG)
    cluster.http.api.background = BackgroundResponses()  # a new router's, for the next tests
    cluster.wait_idle()


def test_a_running_response_is_neither_continued_nor_started_again(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    queued = running(client)
    with pytest.raises(openai.BadRequestError, match="is in_progress") as refused:
        client.responses.create(input="And?", previous_response_id=queued.id, **GREEDY)
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
    again = httpx.post(
        f"{cluster.http_url}/v1/responses",
        json={**LONG, "background": True},
        headers={"x-request-id": queued.id.removeprefix("resp_")},
    )
    assert again.status_code == 400 and "is running" in again.text
    client.responses.delete(queued.id)  # cancels it: it is not stored again as it ends
    cluster.wait_idle()
    assert cluster.http is not None and len(cluster.http.api.background) == 0
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(queued.id)


def test_a_background_stream_is_resumed_where_it_dropped(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """OpenAI's way back into a stream whose connection dropped: the events after the last
    one seen, by `sequence_number`, with nothing lost or repeated, while it runs and after."""
    first: list[Any] = []
    with client.responses.create(background=True, stream=True, **LONG) as stream:
        for event in stream:
            first.append(event)
            if event.type == "response.output_text.delta" and len(first) > 12:
                break  # the connection drops
    created = first[0].response
    assert (first[0].type, created.status, created.background) == (
        "response.created",
        "queued",
        True,
    )
    cursor = first[-1].sequence_number
    with client.responses.retrieve(created.id, stream=True, starting_after=cursor) as rest:
        resumed = list(rest)
    seen = [*first, *resumed]
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    assert seen[-1].type == "response.incomplete"  # cut by max_output_tokens
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    kept = client.responses.retrieve(created.id)
    assert kept.output_text == text and kept.model_dump() == seen[-1].response.model_dump()
    with client.responses.retrieve(created.id, stream=True) as again:  # ended: from the start
        assert [e.sequence_number for e in again] == list(range(len(seen)))
    url = f"{cluster.http_url}/v1/responses/{created.id}"
    for after in ("x", "²", str(len(seen))):  # past the end of an ended one, too
        bad = httpx.get(url, params={"stream": "true", "starting_after": after})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "starting_after"
    last = httpx.get(url, params={"stream": "true", "starting_after": len(seen) - 1})
    assert last.status_code == 200 and last.text == ""  # nothing after the last event
    cluster.wait_idle()


def test_only_a_background_stream_is_resumed(client: openai.OpenAI, cluster: LocalCluster) -> None:
    """A foreground response, a background one not streamed, and a foreground one that took
    an ended background stream's id: none has events to resume."""
    url = f"{cluster.http_url}/v1/responses"
    polled_one = client.responses.create(input="Hi.", background=True, **GREEDY)
    polled(client, polled_one.id, ENDED)
    reused = {"x-request-id": "reused"}
    with httpx.stream(
        "POST", url, json={**GREEDY, "input": "Hi.", "background": True, "stream": True},
        headers=reused,
    ) as streaming:  # fmt: skip
        assert streaming.read().decode().count("event: ") > 2
    assert httpx.get(f"{url}/resp_reused?stream=true").status_code == 200
    foreground = httpx.post(url, json={**GREEDY, "input": "Hi."}, headers=reused).json()
    for response_id in (polled_one.id, foreground["id"]):
        refused = httpx.get(f"{url}/{response_id}?stream=true")
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"
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
    ended = polled(client, queued.id, ENDED)
    assert ended.status == "failed" and ended.error is not None
    assert ended.error.message.startswith("input: ") and ended.error.code == "invalid_prompt"
    assert "maximum context length" in ended.error.message
    cluster.wait_idle()


@pytest.mark.parametrize(
    ("change", "words"),
    [
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


def test_a_generation_cancelled_early_or_broken_still_ends() -> None:
    """Made-up streams: cancelled while it waits for its first token, a response is stored
    cancelled, not left in progress; a bug in the generation stores it failed, not
    in_progress forever."""
    kept: dict[str, Any] = {}

    def keep(response: Any) -> Any:
        kept[response.id] = response
        return response.model_copy(update={"store": True})

    async def broken() -> Any:
        yield serving_pb2.GenerateResponse(index=0, text="Hi", token_ids=[5], worker="w")
        raise RuntimeError("a bug")

    async def never() -> Any:
        await asyncio.sleep(60)
        yield serving_pb2.GenerateResponse()

    async def run() -> None:
        background = BackgroundResponses()
        for name, stream in (("broken", broken()), ("early", never())):
            queued = responses_output.shell(
                ResponsesRequest(model=MODEL, input="q", background=True), f"resp_{name}", MODEL
            ).model_copy(update={"status": "queued"})
            await background.start("", queued, stream, frozenset(), lambda p: None, keep)
        assert await background.cancel("", "resp_early")  # before its first token
        await asyncio.sleep(0.05)
        assert len(background) == 0

    asyncio.run(run())
    assert kept["resp_early"].status == "cancelled"
    broken_one = kept["resp_broken"]
    assert broken_one.status == "failed" and "RuntimeError: a bug" in broken_one.error.message
    assert broken_one.output[0].content[0].text == "Hi"


def test_the_events_of_ended_responses_are_kept_within_their_bound() -> None:
    """Made-up streams: the most recent ended responses' events are kept, the least recent
    dropped past the bound; a response too large for it keeps none."""

    async def short(text: str) -> Any:
        yield serving_pb2.GenerateResponse(
            index=0, text=text, token_ids=[5], finished=True, finish_reason="stop", worker="w"
        )

    async def run() -> dict[str, int | None]:
        one = EventLog()
        one.append(
            b"".join(
                [
                    e
                    async for e in responses_stream.events(
                        shell("resp_x"), None, short("Hi"), frozenset()
                    )
                ]
            )
        )
        background = BackgroundResponses(ended_log_bytes=2 * one.bytes + 10)
        for name in ("a", "b", "c"):
            await background.start(
                "", shell(f"resp_{name}"), short("Hi"), frozenset(), lambda p: None, stored, True
            )
        await asyncio.sleep(0.05)
        large = BackgroundResponses(ended_log_bytes=one.bytes // 2)
        await large.start(
            "", shell("resp_d"), short("Hi"), frozenset(), lambda p: None, stored, True
        )
        await asyncio.sleep(0.05)
        kept = {n: background.events("", f"resp_{n}") for n in "abc"}
        kept["d"] = large.events("", "resp_d")
        return {n: log.bytes if log is not None else None for n, log in kept.items()}

    def shell(response_id: str) -> Any:
        body = ResponsesRequest(model=MODEL, input="q", background=True)
        return responses_output.shell(body, response_id, MODEL).model_copy(
            update={"status": "queued"}
        )

    def stored(response: Any) -> Any:
        return response.model_copy(update={"store": True})

    kept = asyncio.run(run())
    assert kept["a"] is None and kept["b"] is not None and kept["c"] is not None
    assert kept["d"] is None, kept
