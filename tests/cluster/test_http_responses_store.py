"""Stored responses on the Responses API, driven by the `openai` SDK over real HTTP on loopback
against local clusters of two tiny-model workers: a response stored by default, retrieved,
its input items listed and deleted; `previous_response_id` answering exactly what the whole
conversation sent again answers, from the cache; streams stored as they end; `store: false`;
tenants that never see each other's responses; and a store that keeps within its bound."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import openai
import pytest

from cluster.config import RouterSection, SecuritySection
from cluster.http import responses_output, responses_stream
from cluster.http.errors import HttpError
from cluster.http.response_store import ResponseStore
from cluster.http.responses_chain import continued, stored
from cluster.http.responses_routes import conversation
from cluster.http.responses_schema import ResponsesRequest
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster, start_cluster
from tests.cluster.tool_fixtures import LONG_CONTEXT, WEATHER
from worker.loader import LoadedModel

MODEL = SERVED_NAME
GREEDY: dict[str, Any] = {"model": MODEL, "max_output_tokens": 6, "temperature": 0}
TOKENS = {"token-acme": "acme", "token-globex": "globex", "token-admin": "*"}
WEATHER_TOOL: list[Any] = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
SMALL_STORE = 8_000
"""Bytes: room for a few short responses, not for one with all the metadata it may carry."""


@pytest.fixture(scope="module")
def tenants(tiny: LoadedModel) -> Iterator[LocalCluster]:
    """Tokens bound to two tenants, and a small store."""
    cluster = start_cluster(
        tiny,
        http=True,
        engine=LONG_CONTEXT,
        router=RouterSection(port=0, response_store_bytes=SMALL_STORE),
        security=SecuritySection(auth_tokens=TOKENS),
    )
    yield cluster
    cluster.close()


def as_tenant(cluster: LocalCluster, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key=token, max_retries=0)


def items(response: Any) -> list[dict[str, Any]]:
    """A response's output items, as a client sends them back."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def test_a_response_is_stored_retrieved_listed_and_deleted(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    created = client.responses.create(input="Name a colour.", metadata={"run": "7"}, **GREEDY)
    assert created.store is True and created.metadata == {"run": "7"}
    again = client.responses.retrieve(created.id)
    assert again.model_dump() == created.model_dump()
    (listed,) = client.responses.input_items.list(created.id)
    assert listed.type == "message" and listed.role == "user"
    assert listed.content[0].text == "Name a colour." and listed.id.startswith("msg_")
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError, match="is not stored"):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)
    with pytest.raises(openai.BadRequestError, match="is not a stored response") as refused:
        client.responses.create(input="And another?", previous_response_id=created.id, **GREEDY)
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
    unstored = client.responses.create(input="Name a colour.", store=False, **GREEDY)
    assert unstored.store is False and unstored.output_text == created.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    cluster.wait_idle()


def test_previous_response_id_answers_as_the_whole_conversation_and_hits_the_cache(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """A follow-up naming the first response gets what sending the whole conversation gets
    (the same prompt: the same input tokens and greedy answer); its prompt is served from the
    cache the first turn left. As at OpenAI, a turn's `instructions` are its own: an agent
    sends them with every turn (a follow-up without them is a prompt the cache has not seen).
    A router restart loses the store: tests/cluster/test_ray_cluster.py."""
    brief = {"instructions": "Answer in one word.", **GREEDY}
    said = "My name is Ada and I keep the radix tree."
    first = client.responses.create(input=said, **brief)
    follow = client.responses.create(
        input="What is my name?", previous_response_id=first.id, **brief
    )
    assert follow.previous_response_id == first.id
    conversation = [{"role": "user", "content": said}, *items(first)]
    whole = client.responses.create(
        input=[*conversation, {"role": "user", "content": "What is my name?"}], store=False, **brief
    )
    assert follow.usage is not None and whole.usage is not None and first.usage is not None
    assert follow.usage.input_tokens == whole.usage.input_tokens
    assert follow.output_text == whole.output_text
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    # a third turn continues the second, which continued the first; without instructions
    third = client.responses.create(input="Thanks.", previous_response_id=follow.id, **GREEDY)
    longer = client.responses.create(
        input=[
            *conversation,
            {"role": "user", "content": "What is my name?"},
            *items(follow),
            {"role": "user", "content": "Thanks."},
        ],
        store=False,
        **GREEDY,
    )
    assert third.usage is not None and longer.usage is not None
    assert third.instructions is None
    assert (third.usage.input_tokens, third.output_text) == (
        longer.usage.input_tokens,
        longer.output_text,
    )
    cluster.wait_idle()


def test_a_call_and_its_output_continue_a_stored_response(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """An agent's loop: the model calls a function; the next request sends only the call's
    output, naming the response that made the call."""
    asked = {"tools": WEATHER_TOOL, "parallel_tool_calls": False, "temperature": 0}
    first = client.responses.create(
        model=MODEL,
        input="Weather in Oslo?",
        tool_choice="required",
        max_output_tokens=150,
        **asked,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}
    follow = client.responses.create(
        model=MODEL,
        input=[output],
        previous_response_id=first.id,
        tool_choice="none",
        max_output_tokens=4,
        **asked,
    )
    whole = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "Weather in Oslo?"}, *items(first), output],
        tool_choice="none",
        max_output_tokens=4,
        store=False,
        **asked,
    )
    assert follow.usage is not None and whole.usage is not None
    assert (follow.usage.input_tokens, follow.output_text) == (
        whole.usage.input_tokens,
        whole.output_text,
    )
    listed = client.responses.input_items.list(follow.id)
    assert [(i.type, i.call_id) for i in listed] == [("function_call_output", call.call_id)]
    cluster.wait_idle()


def test_a_stream_is_stored_as_it_ends(client: openai.OpenAI, cluster: LocalCluster) -> None:
    with client.responses.stream(input="Name a tree.", **GREEDY) as stream:
        events = list(stream)
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    streamed = last.response  # type: ignore[union-attr]
    assert events[0].response.store is True  # type: ignore[union-attr]
    kept = client.responses.retrieve(streamed.id)
    assert kept.model_dump() == streamed.model_dump()
    follow = client.responses.create(
        input="Another?", previous_response_id=streamed.id, store=False, **GREEDY
    )
    assert follow.status in ("completed", "incomplete") and follow.store is False
    cluster.wait_idle()


def text(item: dict[str, Any]) -> str:
    """A listed message's text: as OpenAI lists it, one input_text part for a string."""
    (part,) = item["content"]
    assert part["type"] == "input_text"
    return part["text"]  # type: ignore[no-any-return]


def test_input_items_page_as_openai_lists_them(cluster: LocalCluster) -> None:
    url = f"{cluster.http_url}/v1/responses"
    turns = [{"role": "user", "content": f"turn {i}"} for i in range(5)]
    created = httpx.post(url, json={**GREEDY, "input": turns}).json()
    listing = f"{url}/{created['id']}/input_items"
    newest = httpx.get(listing, params={"limit": 2}).json()
    assert [text(i) for i in newest["data"]] == ["turn 4", "turn 3"]
    assert all(i["status"] == "completed" and i["type"] == "message" for i in newest["data"])
    assert newest["has_more"] is True and newest["last_id"] == newest["data"][1]["id"]
    rest = httpx.get(listing, params={"limit": 20, "after": newest["last_id"]}).json()
    assert [text(i) for i in rest["data"]] == ["turn 2", "turn 1", "turn 0"]
    assert rest["has_more"] is False
    oldest = httpx.get(listing, params={"order": "asc", "limit": 1}).json()
    assert [text(i) for i in oldest["data"]] == ["turn 0"]
    for params, param in (
        ({"limit": 0}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"limit": "²"}, "limit"),  # a digit to str.isdigit, not to int
        ({"order": "up"}, "order"),
        ({"after": "msg_none"}, "after"),
    ):
        answer = httpx.get(listing, params=params)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param
    answer = httpx.get(f"{url}/{created['id']}", params={"stream": "true"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "stream"
    cluster.wait_idle()


def test_a_tenant_sees_only_its_own_responses(tenants: LocalCluster) -> None:
    acme, globex = as_tenant(tenants, "token-acme"), as_tenant(tenants, "token-globex")
    mine = acme.responses.create(input="Acme's secret plan.", **GREEDY)
    with pytest.raises(openai.NotFoundError):
        globex.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        globex.responses.input_items.list(mine.id)
    with pytest.raises(openai.NotFoundError):
        globex.responses.delete(mine.id)
    with pytest.raises(openai.BadRequestError, match="is not a stored response"):
        globex.responses.create(input="Go on.", previous_response_id=mine.id, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        globex.responses.cancel(mine.id)
    queued = acme.responses.create(
        input="Acme's long plan.", background=True, **GREEDY | {"max_output_tokens": 300}
    )
    with pytest.raises(openai.NotFoundError):
        globex.responses.cancel(queued.id)  # running, and still not globex's
    deadline = time.monotonic() + 60
    while acme.responses.retrieve(queued.id).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert acme.responses.retrieve(queued.id).status in ("completed", "incomplete")
    assert acme.responses.retrieve(mine.id).output_text == mine.output_text
    answer = httpx.get(
        f"{tenants.http_url}/v1/responses/{mine.id}",
        headers={"authorization": "Bearer token-globex", "x-radixmesh-tenant": "acme"},
    )
    assert answer.status_code == 403, answer.text
    answer = httpx.get(f"{tenants.http_url}/v1/responses/{mine.id}")
    assert answer.status_code == 401
    tenants.wait_idle()


def test_the_store_keeps_within_its_bound(tenants: LocalCluster) -> None:
    """The least recently used response goes first; reading one keeps it; one larger than the
    whole store is answered and not kept."""
    acme = as_tenant(tenants, "token-acme")
    assert tenants.http is not None
    store = tenants.http.api.responses
    read = acme.responses.create(input="Keep me.", **GREEDY)
    made = []
    for i in range(40):
        made.append(acme.responses.create(input=f"Response {i}.", **GREEDY))
        acme.responses.retrieve(read.id)  # the most recently used, again
    assert 3 <= len(store) < 20
    with pytest.raises(openai.NotFoundError):
        acme.responses.retrieve(made[0].id)
    assert acme.responses.retrieve(made[-1].id).id == made[-1].id
    assert acme.responses.retrieve(read.id).id == read.id
    most = {f"k{i}": "v" * 512 for i in range(16)}
    large = acme.responses.create(input="Large.", metadata=most, **GREEDY)
    assert large.status in ("completed", "incomplete") and large.store is False
    with pytest.raises(openai.NotFoundError):
        acme.responses.retrieve(large.id)
    assert acme.responses.retrieve(made[-1].id).id == made[-1].id  # nothing dropped for it
    with pytest.raises(openai.BadRequestError, match="larger than the router's whole store"):
        acme.responses.create(input="Large.", metadata=most, background=True, **GREEDY)
    tenants.wait_idle()


def test_a_token_for_every_tenant_reads_the_one_it_names(tenants: LocalCluster) -> None:
    mine = as_tenant(tenants, "token-acme").responses.create(input="Acme's.", **GREEDY)
    url = f"{tenants.http_url}/v1/responses/{mine.id}"
    admin = {"authorization": "Bearer token-admin"}
    assert httpx.get(url, headers=admin | {"x-radixmesh-tenant": "acme"}).status_code == 200
    assert httpx.get(url, headers=admin).status_code == 404  # tenant "": not acme's
    own = {"authorization": "Bearer token-acme", "x-radixmesh-tenant": "acme"}
    assert httpx.get(url, headers=own).status_code == 200
    tenants.wait_idle()


def test_a_request_id_used_again_replaces_the_response(tenants: LocalCluster) -> None:
    """Response ids are `resp_` + the request id, which X-Request-Id sets: the newer response
    of an id is the stored one, and one too large for the store leaves none behind."""
    url = f"{tenants.http_url}/v1/responses"
    headers = {"authorization": "Bearer token-acme", "x-request-id": "again"}
    for n in ("1", "2"):
        made = httpx.post(
            url, json={**GREEDY, "input": "Hi.", "metadata": {"n": n}}, headers=headers
        )
        assert made.json()["id"] == "resp_again" and made.json()["store"] is True
    assert httpx.get(f"{url}/resp_again", headers=headers).json()["metadata"] == {"n": "2"}
    most = {f"k{i}": "v" * 512 for i in range(16)}
    large = httpx.post(url, json={**GREEDY, "input": "Hi.", "metadata": most}, headers=headers)
    assert large.json()["store"] is False
    assert httpx.get(f"{url}/resp_again", headers=headers).status_code == 404
    tenants.wait_idle()


def test_a_client_that_leaves_mid_stream_leaves_a_cancelled_response(
    cluster: LocalCluster,
) -> None:
    """What it was sent is stored, `cancelled`; and the generation stops."""
    body = {**GREEDY, "input": "Tell a long story.", "max_output_tokens": 600, "stream": True}
    sent, response_id = "", None
    with httpx.stream("POST", f"{cluster.http_url}/v1/responses", json=body) as streaming:
        for line in streaming.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line.removeprefix("data: "))
            if event["type"] == "response.created":
                response_id = event["response"]["id"]
            if event["type"] == "response.output_text.delta":
                sent += event["delta"]
                if len(sent) >= 8:
                    break  # and close the connection
    assert response_id is not None
    cluster.wait_idle()
    kept = httpx.get(f"{cluster.http_url}/v1/responses/{response_id}").json()
    assert kept["status"] == "cancelled", kept
    (message,) = kept["output"]
    assert message["status"] == "incomplete" and message["content"][0]["text"].startswith(sent)
    assert kept["usage"]["output_tokens"] < 600


def test_continuing_with_only_a_call_is_a_turn() -> None:
    """An input of calls alone joins the stored answer's turn, as in the whole conversation."""
    answer = [{"type": "output_text", "text": "I'll look."}]
    earlier = [
        {"type": "message", "role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant", "content": answer},
    ]
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    follow = ResponsesRequest(model=MODEL, input=[call], previous_response_id="resp_1")
    turns: list[Any] = []
    assert conversation(follow, turns, earlier) == ["previous_response_id"] * 2
    whole: list[Any] = []
    conversation(ResponsesRequest(model=MODEL, input=[*earlier, call]), whole)
    assert turns == whole and len(turns[1].tool_calls) == 1
    with pytest.raises(HttpError, match="holds no message") as refused:
        reasoning = {"type": "reasoning", "summary": [], "content": []}
        conversation(ResponsesRequest(model=MODEL, input=[reasoning]), [], earlier)
    assert refused.value.param == "input"


def test_store_true_is_refused_where_none_are_kept() -> None:
    off = ResponseStore(0)
    with pytest.raises(HttpError, match="keeps no responses") as refused:
        stored(ResponsesRequest(model=MODEL, input="x", store=True), off)
    assert refused.value.param == "store"
    follow = ResponsesRequest(model=MODEL, input="x", previous_response_id="resp_1")
    with pytest.raises(HttpError, match="keeps no responses") as refused:
        continued(follow, off, "")
    assert refused.value.param == "previous_response_id"
    assert stored(ResponsesRequest(model=MODEL, input="x"), off) is False
    assert stored(ResponsesRequest(model=MODEL, input="x", store=False), off) is False
    assert stored(ResponsesRequest(model=MODEL, input="x"), ResponseStore(1)) is True


def test_a_failed_stream_is_stored_failed() -> None:
    """A worker that fails mid-stream: the failed response, with the text sent so far, is
    what goes to the store (and what the last event carries)."""
    shell = responses_output.shell(
        ResponsesRequest(model=MODEL, input="q"), "resp_x", MODEL, store=True
    )
    first = serving_pb2.GenerateResponse(index=0, text="Hel", token_ids=[5], worker="worker-0")
    failing = serving_pb2.GenerateResponse(
        index=0, finished=True, finish_reason="error", token_ids=[6], worker="worker-0"
    )
    ended: list[Any] = []

    async def rest() -> Any:
        yield failing

    def keep(response: Any) -> Any:
        ended.append(response)
        return response.model_copy(update={"metadata": {"kept": "yes"}})

    async def last() -> dict[str, Any]:
        out = b""
        async for raw in responses_stream.events(shell, first, rest(), frozenset(), keep):
            out += raw
        final = out.decode().strip().split("\n")[-1]
        return json.loads(final.removeprefix("data: "))  # type: ignore[no-any-return]

    event = asyncio.run(last())
    (response,) = ended
    assert response.status == "failed" and response.output[0].content[0].text == "Hel"
    assert event["type"] == "response.failed"
    assert event["response"]["metadata"] == {"kept": "yes"}  # the stored one is what is sent


def test_a_stream_closed_at_an_event_is_stored_cancelled() -> None:
    """The other way a client leaves: the stream closed while it waits at an event (the
    server writing), not cancelled while it waits for a token; what was sent is stored."""
    shell = responses_output.shell(
        ResponsesRequest(model=MODEL, input="q"), "resp_x", MODEL, store=True
    )
    ended: list[Any] = []

    async def rest() -> Any:
        yield serving_pb2.GenerateResponse(index=0, text="Hel", token_ids=[5], worker="w")
        yield serving_pb2.GenerateResponse(index=0, text="lo", token_ids=[6], worker="w")

    def keep(response: Any) -> Any:
        ended.append(response)
        return response

    async def leave() -> None:
        stream = responses_stream.events(shell, None, rest(), frozenset(), keep)
        async for raw in stream:
            if b"output_text.delta" in raw:
                break  # at the first delta's event
        await stream.aclose()

    asyncio.run(leave())
    (response,) = ended
    assert response.status == "cancelled" and response.output[0].content[0].text == "Hel"
