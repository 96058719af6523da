"""Stored chat completions (`store: true`), driven by the `openai` SDK's `chat.completions`
`create / retrieve / list / update / delete` and `messages.list` over real HTTP on loopback,
against a local cluster of two tiny-model workers: a completion kept as answered (whole or
streamed, with its tool calls and logprobs), listed in order with its metadata and model as
filters, paged, its metadata replaced, deleted; each tenant's own; nothing kept without
`store`, nor of a stream whose client left; refusals by name."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx2 as httpx
import openai
import pytest

from cluster.http import list_places
from cluster.http.errors import HttpError
from cluster.http.openai_responses import Counts, Sample
from cluster.http.openai_schema import ChatChoice, ChatCompletion, ChatCompletionRequest, Usage
from cluster.http.stored_completions import (
    CompletionStore,
    kept,
    kept_at_the_end,
    storing,
)
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster
from tests.cluster.test_http_responses import QUESTION
from tests.cluster.tool_fixtures import WEATHER

MODEL = SERVED_NAME
ASK: list[Any] = [
    {"role": "system", "content": "Be brief."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "the quick "}, {"type": "text", "text": "fox"}],
    },
]
GREEDY: dict[str, Any] = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 6}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
]
CALLING: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": QUESTION}],
    "tools": TOOLS,
    "tool_choice": "required",
    "max_tokens": 120,
    "temperature": 0,
    "store": True,
}
"""A stored request that must call get_weather."""


@pytest.fixture
def tenant(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    """The SDK as a tenant of this test's own (X-Radixmesh-Tenant), so that listings see only
    the test's completions."""
    headers = {"x-radixmesh-tenant": request.node.name[:60]}
    with openai.OpenAI(
        base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0, default_headers=headers
    ) as client:
        yield client


def test_a_stored_completion_reads_back_as_answered(
    tenant: openai.OpenAI, cluster: LocalCluster
) -> None:
    answered = tenant.chat.completions.create(
        **GREEDY, store=True, metadata={"run": "a", "split": "eval"}, seed=7
    )
    kept = tenant.chat.completions.retrieve(answered.id)
    assert kept.model_dump(exclude={"metadata"}, exclude_none=True) | {} == {
        **answered.model_dump(exclude_none=True),
        "temperature": 0.0,
        "seed": 7,
    }
    shown = kept.model_dump()
    assert shown["metadata"] == {"run": "a", "split": "eval"}
    assert shown["top_p"] is None and shown["tools"] is None  # not set: null, as OpenAI shows
    messages = list(tenant.chat.completions.messages.list(answered.id))
    assert [m.id for m in messages] == [f"{answered.id}-0", f"{answered.id}-1"]
    assert [(m.role, m.content) for m in messages] == [  # type: ignore[comparison-overlap]
        ("system", "Be brief."),
        ("user", "the quick fox"),
    ]
    assert messages[1].content_parts is None  # text parts only: none kept apart
    last = tenant.chat.completions.messages.list(answered.id, order="desc", limit=1)
    assert [m.id for m in last.data] == [f"{answered.id}-1"] and last.has_more
    cluster.wait_idle()


def test_nothing_is_kept_unless_asked(tenant: openai.OpenAI, cluster: LocalCluster) -> None:
    plain = tenant.chat.completions.create(**GREEDY)
    said_no = tenant.chat.completions.create(**GREEDY, store=False, metadata={"k": "v"})
    for answered in (plain, said_no):
        with pytest.raises(openai.NotFoundError) as err:
            tenant.chat.completions.retrieve(answered.id)
        assert "not stored for this tenant" in str(err.value)
    assert list(tenant.chat.completions.list()) == []
    cluster.wait_idle()


def test_a_stream_is_kept_as_it_ended(tenant: openai.OpenAI, cluster: LocalCluster) -> None:
    chunks = list(
        tenant.chat.completions.create(
            **GREEDY, store=True, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    kept = tenant.chat.completions.retrieve(chunks[0].id)
    assert kept.choices[0].message.content == text
    assert kept.choices[0].finish_reason == chunks[-2].choices[0].finish_reason
    assert kept.usage == chunks[-1].usage and kept.created == chunks[0].created
    cluster.wait_idle()


def test_tool_calls_and_logprobs_are_kept_as_answered(
    tenant: openai.OpenAI, cluster: LocalCluster
) -> None:
    answered = tenant.chat.completions.create(**CALLING, logprobs=True, top_logprobs=2)
    calls = answered.choices[0].message.tool_calls
    assert calls, answered
    kept = tenant.chat.completions.retrieve(answered.id)
    assert kept.choices == answered.choices  # the same call ids: built once
    assert kept.model_dump()["tool_choice"] == "required"
    assert kept.model_dump()["tools"][0]["function"]["name"] == "get_weather"
    cluster.wait_idle()


def test_a_streamed_calls_ids_are_kept_as_streamed(
    tenant: openai.OpenAI, cluster: LocalCluster
) -> None:
    chunks = list(tenant.chat.completions.create(**CALLING, stream=True))
    streamed = [
        (call.id, call.function.name if call.function else None)
        for c in chunks
        if c.choices
        for call in c.choices[0].delta.tool_calls or []
    ]
    assert streamed and all(call_id for call_id, _ in streamed)
    kept = tenant.chat.completions.retrieve(chunks[0].id)
    calls = kept.choices[0].message.tool_calls or []
    assert [(c.id, c.function.name) for c in calls] == streamed  # type: ignore[union-attr]
    cluster.wait_idle()


def test_listing_orders_filters_and_pages(tenant: openai.OpenAI, cluster: LocalCluster) -> None:
    ids = []
    for k in range(5):
        metadata = {"k": str(k), "parity": "even" if k % 2 == 0 else "odd"}
        ids.append(tenant.chat.completions.create(**GREEDY, store=True, metadata=metadata).id)
    assert [c.id for c in tenant.chat.completions.list()] == ids  # oldest first by default
    assert [c.id for c in tenant.chat.completions.list(order="desc")] == ids[::-1]
    paged = tenant.chat.completions.list(limit=2)
    assert [c.id for c in paged.data] == ids[:2] and paged.has_more
    assert [c.id for c in paged] == ids  # the SDK follows `after` through the pages
    evens = tenant.chat.completions.list(metadata={"parity": "even"})
    assert [c.id for c in evens] == ids[0::2]
    one = tenant.chat.completions.list(metadata={"parity": "odd", "k": "3"})
    assert [c.id for c in one] == [ids[3]]
    assert list(tenant.chat.completions.list(model="another")) == []
    assert len(list(tenant.chat.completions.list(model=MODEL))) == 5
    tenant.chat.completions.retrieve(ids[0])  # read: the store's order changes, the list's not
    assert [c.id for c in tenant.chat.completions.list()] == ids
    cluster.wait_idle()


def test_metadata_is_replaced_and_a_deleted_one_is_gone(
    tenant: openai.OpenAI, cluster: LocalCluster
) -> None:
    first = tenant.chat.completions.create(**GREEDY, store=True, metadata={"stage": "draft"})
    changed = tenant.chat.completions.update(first.id, metadata={"stage": "final", "by": "me"})
    assert changed.model_dump()["metadata"] == {"stage": "final", "by": "me"}
    assert tenant.chat.completions.retrieve(first.id).choices == first.choices
    assert [c.id for c in tenant.chat.completions.list(metadata={"stage": "final"})] == [first.id]
    assert list(tenant.chat.completions.list(metadata={"stage": "draft"})) == []
    cleared = tenant.chat.completions.update(first.id, metadata=None)
    assert cleared.model_dump()["metadata"] == {}
    gone = tenant.chat.completions.delete(first.id)
    assert (gone.id, gone.deleted, gone.object) == (first.id, True, "chat.completion.deleted")
    for call in (
        lambda: tenant.chat.completions.retrieve(first.id),
        lambda: tenant.chat.completions.delete(first.id),
        lambda: tenant.chat.completions.update(first.id, metadata={}),
        lambda: tenant.chat.completions.messages.list(first.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    cluster.wait_idle()


def test_a_tenant_sees_only_its_own(cluster: LocalCluster) -> None:
    url = f"{cluster.http_url}/v1/chat/completions"
    acme, globex = ({"x-radixmesh-tenant": name} for name in ("acme-own", "globex-own"))
    body = GREEDY | {"store": True}
    made = httpx.post(url, json=body, headers=acme, timeout=60).json()["id"]
    assert httpx.get(f"{url}/{made}", headers=globex).status_code == 404
    assert httpx.delete(f"{url}/{made}", headers=globex).status_code == 404
    assert httpx.get(url, headers=globex).json()["data"] == []
    assert [c["id"] for c in httpx.get(url, headers=acme).json()["data"]] == [made]
    assert httpx.get(f"{url}/{made}", headers=acme).status_code == 200
    cluster.wait_idle()


def test_a_stream_whose_client_left_is_not_kept(cluster: LocalCluster) -> None:
    headers = {"x-radixmesh-tenant": "left"}
    url = f"{cluster.http_url}/v1/chat/completions"
    body = GREEDY | {"store": True, "stream": True, "max_tokens": 400, "ignore_eos": True}
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as answer:
        lines = answer.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
    made = json.loads(first.removeprefix("data: "))["id"]
    cluster.wait_idle()
    assert httpx.get(f"{url}/{made}", headers=headers).status_code == 404
    assert httpx.get(url, headers=headers).json()["data"] == []


@pytest.mark.parametrize(
    ("path", "query", "param"),
    [
        ("", {"limit": "0"}, "limit"),
        ("", {"limit": "101"}, "limit"),
        ("", {"order": "newest"}, "order"),
        ("", {"after": "chatcmpl-nope"}, "after"),
        ("", {"status": "completed"}, "status"),
        ("/ID/messages", {"after": "ID-9"}, "after"),
        ("/ID/messages", {"model": MODEL}, "model"),
    ],
)
def test_listing_refusals_name_the_parameter(
    cluster: LocalCluster, path: str, query: dict[str, str], param: str
) -> None:
    url = f"{cluster.http_url}/v1/chat/completions"
    headers = {"x-radixmesh-tenant": "refusals"}
    made = httpx.post(url, json=GREEDY | {"store": True}, headers=headers, timeout=60).json()["id"]
    answer = httpx.get(url + path.replace("ID", made), params=query, headers=headers)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.json()
    cluster.wait_idle()


@pytest.mark.parametrize(
    ("url", "body", "param", "words"),
    [
        (
            "/v1/chat/completions",
            {"metadata": {f"k{i}": "v" for i in range(17)}},
            "metadata",
            "at most 16",
        ),
        ("/v1/chat/completions", {"metadata": {"k": "v" * 513}}, "metadata.k", "512"),
        ("/v1/chat/completions", {"metadata": {"k": 1}}, "metadata.k", "string"),
        ("/v1/chat/completions", {"store": "yes"}, "store", "boolean"),
        ("/v1/completions", {"store": True}, "store", "not supported"),
        ("/v1/completions", {"metadata": {"k": "v"}}, "metadata", "not supported"),
    ],
)
def test_create_refusals_name_the_field(
    cluster: LocalCluster, url: str, body: dict[str, Any], param: str, words: str
) -> None:
    base = GREEDY if url.endswith("chat/completions") else {"model": MODEL, "prompt": "hi"}
    answer = httpx.post(f"{cluster.http_url}{url}", json=base | body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_an_update_refuses_what_it_does_not_change(
    tenant: openai.OpenAI, cluster: LocalCluster
) -> None:
    made = tenant.chat.completions.create(**GREEDY, store=True)
    url = f"{cluster.http_url}/v1/chat/completions/{made.id}"
    headers = {"x-radixmesh-tenant": "test_an_update_refuses_what_it_does_not_change"}
    for body, param in (({"model": "x", "metadata": {}}, "model"), ({}, "metadata")):
        answer = httpx.post(url, json=body, headers=headers)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    cluster.wait_idle()


def test_a_router_that_keeps_none_refuses_store() -> None:
    body = ChatCompletionRequest.model_validate(GREEDY | {"store": True})
    with pytest.raises(HttpError) as err:
        storing(body, CompletionStore(0))
    assert err.value.param == "store" and "response_store_bytes is 0" in err.value.message
    assert storing(ChatCompletionRequest.model_validate(GREEDY), CompletionStore(0)) is False


def test_the_store_keeps_within_its_bound() -> None:
    """The least recently used go first; what is kept counts what it holds."""
    body = ChatCompletionRequest.model_validate(GREEDY | {"metadata": {"k": "v" * 100}})
    store = CompletionStore(20_000)
    ids = []
    for k in range(60):
        answered = ChatCompletion(
            id=f"chatcmpl-{k}",
            created=int(time.time()),
            model=MODEL,
            choices=[
                ChatChoice.model_validate(
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "x" * 50},
                        "finish_reason": "stop",
                    }
                )
            ],
            usage=Usage.model_validate(
                {
                    "prompt_tokens": 1,
                    "completion_tokens": 1,
                    "total_tokens": 2,
                    "prompt_tokens_details": {"cached_tokens": 0},
                }
            ),
        )
        record = kept(body, answered, store.next_place())
        assert record.size > len(record.completion) + sum(map(len, record.messages))
        assert store.put("t", record.key, record)
        ids.append(record.key)
        assert store.bytes <= store.max_bytes
    held = [key for key, _ in store.of("t")]
    assert 0 < len(held) < 60 and held == ids[-len(held) :]
    assert store.bytes == sum(v.size for _, v in store.of("t"))
    last = store.get("t", ids[-1])
    assert last is not None
    huge = replace(last, metadata={"x": "y" * 20_000})
    assert not store.put("t", last.key, huge)  # larger than the store: not kept, the old gone
    assert store.get("t", last.key) is None
    assert store.place("t", ids[0]) == store.place("t", ids[0]) is not None  # dropped: placed
    assert store.place("t", "chatcmpl-never") is None
    # the gone places are forgotten from the tenant remembering the most: another tenant
    # deleting many does not forget this one's
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(list_places, "MAX_GONE", 3)
        mine = replace(last, key="chatcmpl-mine", sequence=store.next_place())
        assert store.put("u", mine.key, mine) and store.delete("u", mine.key)
        for k in range(5):
            theirs = replace(last, key=f"chatcmpl-x{k}", sequence=store.next_place())
            assert store.put("v", theirs.key, theirs) and store.delete("v", theirs.key)
        assert store.place("u", mine.key) == mine.sequence


def test_paging_goes_on_past_deleted_and_changed_ones(
    tenant: openai.OpenAI, cluster: LocalCluster
) -> None:
    """A client that changes (or deletes) what it lists, page by page, names a completion no
    longer matching (or gone) in the next page's `after`: the listing goes on from there."""
    body = GREEDY | {"max_tokens": 1, "store": True, "metadata": {"s": "draft"}}
    ids = [tenant.chat.completions.create(**body).id for _ in range(7)]
    changed = []
    for made in tenant.chat.completions.list(limit=2, metadata={"s": "draft"}):
        changed.append(made.id)
        tenant.chat.completions.update(made.id, metadata={"s": "final"})
    assert changed == ids
    newest_first = [c.id for c in tenant.chat.completions.list(limit=2, order="desc")]
    assert newest_first == ids[::-1]
    deleted = []
    for made in tenant.chat.completions.list(limit=3):
        deleted.append(made.id)
        tenant.chat.completions.delete(made.id)
    assert deleted == ids and list(tenant.chat.completions.list()) == []
    cluster.wait_idle()


def made_up(finish: str) -> list[serving_pb2.GenerateResponse]:
    first = serving_pb2.GenerateResponse(index=0, text="Hi", token_ids=[5], worker="w")
    last = serving_pb2.GenerateResponse(
        index=0, text="", token_ids=[], worker="w", finished=True, finish_reason=finish
    )
    return [first, last]


@pytest.mark.parametrize(("finish", "keeps"), [("stop", True), ("length", True), ("abort", False)])
def test_a_stream_is_kept_only_when_it_ended_as_a_generation(finish: str, keeps: bool) -> None:
    """An aborted generation (its worker stopping, `/abort_request`) is not kept."""
    kept_ones: list[Any] = []

    async def keep(completion: Any) -> None:
        kept_ones.append(completion)

    async def stream() -> Any:
        for response in made_up(finish):
            yield response

    def whole(samples: dict[int, Sample], counts: Counts) -> Any:
        return "".join(samples[0].text)

    async def run() -> list[str]:
        return [r.text async for r in kept_at_the_end(stream(), whole, keep, False)]

    assert asyncio.run(run()) == ["Hi", ""]  # passed on as it came
    assert kept_ones == (["Hi"] if keeps else [])
