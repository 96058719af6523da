"""OpenAI's Conversations API (cluster/http/conversations.py) on a local cluster of two
tiny-model workers, through the `openai` SDK: conversations made, read, relabelled and
deleted; items added, listed in pages, read and deleted; a response made in a conversation
renders its items before its input (the answer the same conversation sent whole gets, its
prefix read from the cache) and adds its input and output as it ends, streamed or not, stored
or not; refusals by name; tenants apart; the store's bound."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster
from tests.cluster.test_http_openai import assert_no_leak
from tests.cluster.tool_fixtures import served
from worker.loader import LoadedModel

MODEL = SERVED_NAME
SYSTEM = {"type": "message", "role": "system", "content": "You answer briefly. " * 8}
GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 5}


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(tiny, ENGINE)


def tenant_client(cluster: LocalCluster, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{cluster.http_url}/v1",
        api_key="none",
        max_retries=0,
        default_headers={"x-radixmesh-tenant": tenant},
    )


def kinds(client: openai.OpenAI, conversation_id: str) -> list[tuple[str, str | None]]:
    items = client.conversations.items.list(conversation_id, order="asc", limit=100)
    return [(item.type, getattr(item, "role", None)) for item in items.data]


def test_a_conversation_is_made_read_relabelled_and_deleted(client: openai.OpenAI) -> None:
    made = client.conversations.create(items=[SYSTEM], metadata={"topic": "tests"})
    assert made.object == "conversation" and made.id.startswith("conv_")
    assert made.metadata == {"topic": "tests"} and made.created_at > 0
    assert client.conversations.retrieve(made.id).metadata == {"topic": "tests"}
    relabelled = client.conversations.update(made.id, metadata={"topic": "other"})
    assert relabelled.metadata == {"topic": "other"}
    gone = client.conversations.delete(made.id)
    assert (gone.id, gone.deleted, gone.object) == (made.id, True, "conversation.deleted")
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(made.id)


def test_items_are_added_listed_in_pages_read_and_deleted(client: openai.OpenAI) -> None:
    made = client.conversations.create()
    added = client.conversations.items.create(
        made.id,
        items=[
            {"type": "message", "role": "user", "content": f"Turn {i}."}  # type: ignore[misc]
            for i in range(5)
        ],
    )
    ids = [item.id for item in added.data]
    assert len(set(ids)) == 5 and added.first_id == ids[0] and added.last_id == ids[-1]
    newest_first = [item.id for item in client.conversations.items.list(made.id, limit=2)]
    assert newest_first == ids[::-1]  # the SDK pages on, `after` the last of each page
    item = client.conversations.items.retrieve(ids[2], conversation_id=made.id)
    assert item.type == "message" and item.content[0].text == "Turn 2."  # type: ignore[union-attr]
    after = client.conversations.items.delete(ids[2], conversation_id=made.id)
    assert after.id == made.id
    left = [item.id for item in client.conversations.items.list(made.id, order="asc")]
    assert left == [*ids[:2], *ids[3:]]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(ids[2], conversation_id=made.id)


def test_a_response_in_a_conversation_continues_it_and_adds_its_turn(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    talk = client.conversations.create(items=[SYSTEM])
    first = client.responses.create(
        model=MODEL, conversation=talk.id, input="Name a river.", **GREEDY
    )
    assert first.conversation is not None and first.conversation.id == talk.id
    assert kinds(client, talk.id) == [
        ("message", "system"),
        ("message", "user"),
        ("message", "assistant"),
    ]
    cluster.wait_idle()
    second = client.responses.create(
        model=MODEL, conversation={"id": talk.id}, input="And a mountain?", **GREEDY
    )
    answered = first.output_text
    whole = client.responses.create(
        model=MODEL,
        input=[
            SYSTEM,  # type: ignore[list-item]
            {"role": "user", "content": "Name a river."},
            {"role": "assistant", "content": answered},
            {"role": "user", "content": "And a mountain?"},
        ],
        store=False,
        **GREEDY,
    )
    assert second.output_text == whole.output_text  # the same chat, rendered from the items
    assert second.usage is not None and whole.usage is not None
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the turn before, cached
    assert len(kinds(client, talk.id)) == 5
    assert_no_leak(cluster)


def test_streamed_and_unstored_responses_add_their_turns_too(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    talk = client.conversations.create(items=[SYSTEM])
    client.responses.create(model=MODEL, conversation=talk.id, input="One?", store=False, **GREEDY)
    events = list(
        client.responses.create(
            model=MODEL, conversation=talk.id, input="Two?", stream=True, **GREEDY
        )
    )
    final = events[-1].response  # type: ignore[union-attr]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert final.conversation is not None and final.conversation.id == talk.id
    assert [role for _, role in kinds(client, talk.id)] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert_no_leak(cluster)


@pytest.mark.parametrize(
    ("items", "named"),
    [
        ([{"type": "message", "role": "robot", "content": "x"}], "items[0].role"),
        ([{"type": "function_call", "name": "f"}], "items[0].call_id"),
        ([{"type": "web_search_call"}], "items[0].type"),
        ([{"type": "message", "role": "user", "content": "x"}] * 21, "at most 20 at a time"),
    ],
)
def test_items_that_would_not_render_are_refused_by_name(
    client: openai.OpenAI, items: list[dict[str, Any]], named: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=named.replace("[", r"\[")):
        client.conversations.create(items=items)  # type: ignore[arg-type]
    made = client.conversations.create()
    with pytest.raises(openai.BadRequestError, match=named.replace("[", r"\[")):
        client.conversations.items.create(made.id, items=items)  # type: ignore[arg-type]
    assert kinds(client, made.id) == []


def test_a_response_names_a_conversation_it_may_continue(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="conversation: 'conv_none' is not a"):
        client.responses.create(model=MODEL, conversation="conv_none", input="x", **GREEDY)
    talk = client.conversations.create(items=[SYSTEM])
    first = client.responses.create(model=MODEL, input="x", **GREEDY)
    with pytest.raises(openai.BadRequestError, match="cannot be given with previous_response_id"):
        client.responses.create(
            model=MODEL,
            conversation=talk.id,
            previous_response_id=first.id,
            input="y",
            **GREEDY,
        )


def test_conversations_are_their_tenants(cluster: LocalCluster) -> None:
    with tenant_client(cluster, "acme") as acme, tenant_client(cluster, "globex") as globex:
        talk = acme.conversations.create(items=[SYSTEM])  # type: ignore[list-item]
        with pytest.raises(openai.NotFoundError):
            globex.conversations.retrieve(talk.id)
        with pytest.raises(openai.NotFoundError):
            globex.conversations.items.list(talk.id)
        with pytest.raises(openai.BadRequestError, match="not a conversation of this tenant"):
            globex.responses.create(model=MODEL, conversation=talk.id, input="x", **GREEDY)
        assert acme.conversations.retrieve(talk.id).id == talk.id


def test_a_conversation_past_the_bound_is_refused_its_items(
    client: openai.OpenAI, cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cluster.http is not None
    store = cluster.http.api.conversations
    made = client.conversations.create(items=[SYSTEM])
    kept = store.get("", made.id)
    assert kept is not None
    monkeypatch.setattr(store, "max_bytes", kept.size + 600)  # others may go: not this
    big = [{"type": "message", "role": "user", "content": "x" * 2000}]
    with pytest.raises(openai.BadRequestError, match=r"router\.response_store_bytes"):
        client.conversations.items.create(made.id, items=big)  # type: ignore[arg-type]
    assert len(kinds(client, made.id)) == 1  # as it was


def test_an_item_id_is_the_conversations_once(client: openai.OpenAI) -> None:
    """Ids name items (to read, delete and page by): one already in the conversation, twice
    in a call, or not a string, is refused by name, on the items route and in a response's
    input alike."""
    made = client.conversations.create(items=[{**SYSTEM, "id": "msg_a"}])  # type: ignore[list-item]
    again = [{"type": "message", "role": "user", "content": "x", "id": "msg_a"}]
    with pytest.raises(openai.BadRequestError, match=r"items\[0\]\.id: 'msg_a' is already"):
        client.conversations.items.create(made.id, items=again)  # type: ignore[arg-type]
    twice = [{"type": "message", "role": "user", "content": "x", "id": "msg_b"}] * 2
    with pytest.raises(openai.BadRequestError, match=r"items\[1\]\.id: 'msg_b' is already"):
        client.conversations.items.create(made.id, items=twice)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match=r"items\[0\]\.id: must be a non-empty"):
        client.conversations.items.create(made.id, items=[{**again[0], "id": 7}])  # type: ignore[list-item]
    with pytest.raises(openai.BadRequestError, match=r"input\[0\]\.id: 'msg_a' is already"):
        client.responses.create(model=MODEL, conversation=made.id, input=again, **GREEDY)  # type: ignore[arg-type]
    assert kinds(client, made.id) == [("message", "system")]


def test_one_response_at_a_time_runs_in_a_conversation(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """While a response runs in a conversation, another is refused (OpenAI's
    conversation_locked); a response refused, streamed or failed lets it go."""
    assert cluster.http is not None
    store = cluster.http.api.conversations
    talk = client.conversations.create(items=[SYSTEM])
    release = store.hold("", talk.id)  # as a response running in it does
    with pytest.raises(openai.BadRequestError) as locked:
        client.responses.create(model=MODEL, conversation=talk.id, input="x", **GREEDY)
    assert locked.value.code == "conversation_locked"
    release()
    with pytest.raises(openai.BadRequestError, match="temperature"):  # the core's refusal
        client.responses.create(
            model=MODEL, conversation=talk.id, input="x", **(GREEDY | {"temperature": -1})
        )
    list(
        client.responses.create(model=MODEL, conversation=talk.id, input="y", stream=True, **GREEDY)
    )
    answered = client.responses.create(model=MODEL, conversation=talk.id, input="z", **GREEDY)
    assert answered.conversation is not None  # each let it go
    assert len(kinds(client, talk.id)) == 5
    with pytest.raises(openai.BadRequestError, match="continue that conversation"):
        client.responses.create(model=MODEL, previous_response_id=answered.id, input="w", **GREEDY)
    assert_no_leak(cluster)
