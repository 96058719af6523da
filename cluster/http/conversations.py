"""OpenAI's Conversations API, as the `openai` SDK calls it (`client.conversations`), and the
Responses API's `conversation`:

    POST   /v1/conversations                      `items` (up to 20), `metadata`
    GET    /v1/conversations/{id}
    POST   /v1/conversations/{id}                 `metadata` replaced
    DELETE /v1/conversations/{id}
    POST   /v1/conversations/{id}/items           up to 20 more items, at its end
    GET    /v1/conversations/{id}/items           `order` (desc), `after`, `limit` (20, 1-100)
    GET    /v1/conversations/{id}/items/{item}
    DELETE /v1/conversations/{id}/items/{item}    answers the conversation

A conversation is a list of Responses API items (messages, reasoning, function calls and their
outputs), each with an id of its own. A response created with `conversation` renders the
conversation's items before its `input`, as `previous_response_id` renders a stored response's,
and once it ends (completed, or incomplete) its input and output items are added to the
conversation's end, whether the response is stored or not, with its truncation's cut. One
response at a time runs in a conversation (`conversation_locked` for another). Each item is
checked as a response's input is when it is added.

Conversations are kept as the stored responses are: in the router's memory, each its tenant's
(another's id is 404), within `router.response_store_bytes` of their own, the largest tenant's least
recently used dropped first, across a restart only with `router.state_dir`. A conversation that
would pass the bound whole is refused its new items or metadata (400), and a response's items that
would make it so are not added (logged; the response is answered all the same).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response as HttpResponse

from cluster.http.errors import HttpError
from cluster.http.kept_files import json_text
from cluster.http.kept_store import KeptStore
from cluster.http.openai_schema import Body
from cluster.http.response_store import ITEM_BYTES, Item
from cluster.http.responses_chain import as_turn, check_metadata, listed_items, owner
from cluster.http.responses_items import check_item
from cluster.http.responses_schema import Response, ResponsesRequest
from cluster.http.stored_routes import page_of

if TYPE_CHECKING:
    from cluster.http.app import HttpApi

log = logging.getLogger(__name__)
MAX_ADDED = 20
"""Items one call adds (OpenAI's bound)."""
ENTRY_BYTES = 512
"""What Python takes to hold one conversation beside its items' bytes."""
HOLD_S = 600.0
"""How long a response's hold on its conversation lasts at most, should it never let go."""


@dataclass(slots=True)
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[bytes] = field(default_factory=list)
    """Each item as JSON, in the conversation's order."""
    ids: list[str] = field(default_factory=list)
    """Each item's id, beside `items` (no two alike)."""
    dropped: int = 0
    """With truncation auto: the turns after its head the last response's prompt left out
    (cluster/http/responses_truncation.py); the next starts from the same cut. Deleting an
    item starts it again from none."""

    @property
    def size(self) -> int:
        meta = sum(len(k) + len(v) for k, v in self.metadata.items())
        return sum(map(len, self.items)) + len(self.items) * ITEM_BYTES + ENTRY_BYTES + meta

    def shown(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.metadata,
        }

    def decoded(self) -> list[Item]:
        return [json.loads(item) for item in self.items]


class ConversationStore(KeptStore[Conversation]):
    """Conversations by (tenant, id); a conversation whose items change is kept again, so its
    size is counted anew. One response at a time runs in a conversation (`hold`). Used from
    the router's event loop only."""

    def __init__(self, max_bytes: int, directory: Path | None = None) -> None:
        super().__init__(max_bytes, directory)
        self._held: dict[tuple[str, str], float] = {}
        """(tenant, conversation id) -> when a response took it (time.monotonic)."""

    def saved(self, value: Conversation) -> dict[str, Any]:
        return {
            "id": value.id,
            "created_at": value.created_at,
            "metadata": value.metadata,
            "items": [item.decode() for item in value.items],
            "ids": value.ids,
            "dropped": value.dropped,
        }

    def restored(self, saved: dict[str, Any]) -> Conversation:
        metadata, ids = saved["metadata"], saved["ids"]
        items = list(map(json_text, saved["items"]))
        if not all(isinstance(v, str) for v in metadata.values()):
            raise TypeError("metadata values are not all strings")
        if len(ids) != len(items) or not all(isinstance(i, str) for i in ids):
            raise ValueError("the item ids are not one string an item")
        return Conversation(
            str(saved["id"]),
            int(saved["created_at"]),
            dict(metadata),
            items,
            list(ids),
            int(saved["dropped"]),
        )

    def add(
        self, tenant: str, conversation: Conversation, items: list[Item], dropped: int = 0
    ) -> bool:
        """Add `items` at the conversation's end (`dropped`: its truncation's cut now); False,
        changing nothing, when it would then be larger than the whole store."""
        encoded = [json.dumps(item).encode() for item in items]
        grown = Conversation(
            conversation.id,
            conversation.created_at,
            conversation.metadata,
            [*conversation.items, *encoded],
            [*conversation.ids, *(item["id"] for item in items)],
            dropped,
        )
        return self.keep(tenant, grown)

    def keep(self, tenant: str, conversation: Conversation) -> bool:
        """Keep a conversation as it now is; False, keeping the one kept before, when it is
        larger than the whole store."""
        if conversation.size > self.max_bytes:
            return False
        return self.put(tenant, conversation.id, conversation)

    def hold(self, tenant: str, conversation_id: str) -> Callable[[], None]:
        """Take the conversation for one response (OpenAI's `conversation_locked` while
        another runs in it); what lets it go, once (a holder that vanished without letting go,
        a client gone before its stream began, lets go after HOLD_S)."""
        key, now = (tenant, conversation_id), time.monotonic()
        taken = self._held.get(key)
        if taken is not None and now - taken < HOLD_S:
            raise HttpError(
                400,
                f"another response is running in conversation {conversation_id!r}: wait for "
                "it to end",
                "conversation",
                code="conversation_locked",
            )
        self._held[key] = now

        def release() -> None:
            if self._held.get(key) == now:
                del self._held[key]

        return release


class CreateConversation(Body):
    items: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None


class UpdateConversation(Body):
    metadata: dict[str, str] | None


class AddItems(Body):
    items: list[dict[str, Any]]


def checked_items(given: list[dict[str, Any]], where: str, taken: Sequence[str] = ()) -> list[Item]:
    """Items to add, each with an id and a status, as a response's input lists them; 400
    naming the first that would not render (`where`: what the request calls the list), or
    whose id is one of `taken` (the conversation's) or another's of the list."""
    if len(given) > MAX_ADDED:
        raise HttpError.invalid(where, f"{len(given)} items; at most {MAX_ADDED} at a time")
    for i, item in enumerate(given):
        if not isinstance(item, dict):
            raise HttpError.invalid(f"{where}[{i}]", "must be an item object")
        check_item(item, f"{where}[{i}]")
    check_new_ids(given, where, taken)
    return listed_items(given)


def check_new_ids(given: Sequence[Any], where: str, taken: Sequence[str]) -> None:
    """400 for an item whose id is not a string, or is one of `taken` or of an item before it
    (a conversation's ids are its items' names: no two alike)."""
    seen = set(taken)
    for i, item in enumerate(given):
        item_id = item.get("id") if isinstance(item, dict) else None
        if item_id is None:
            continue
        if not isinstance(item_id, str) or not item_id:
            raise HttpError.invalid(f"{where}[{i}].id", "must be a non-empty string")
        if item_id in seen:
            raise HttpError.invalid(
                f"{where}[{i}].id", f"{item_id!r} is already an item of the conversation"
            )
        seen.add(item_id)


def named(body_conversation: Any) -> str | None:
    """The id a response's `conversation` names (a string, or `{"id": ...}`)."""
    if body_conversation is None:
        return None
    if isinstance(body_conversation, str):
        return body_conversation
    if isinstance(body_conversation, dict) and isinstance(body_conversation.get("id"), str):
        if set(body_conversation) - {"id"}:
            raise HttpError.invalid("conversation", "an object holds only its id")
        return str(body_conversation["id"])
    raise HttpError.invalid("conversation", "must be a conversation's id, or {'id': ...}")


def joined(body: ResponsesRequest, store: ConversationStore, tenant: str) -> Conversation | None:
    """The conversation a response's `conversation` names (None: it names none)."""
    conversation_id = named(body.conversation)
    if conversation_id is None:
        return None
    if body.previous_response_id is not None:
        raise HttpError.invalid("conversation", "cannot be given with previous_response_id")
    if not store.enabled:
        raise HttpError.invalid(
            "conversation", "this router keeps no conversations (router.response_store_bytes is 0)"
        )
    kept = store.get(tenant, conversation_id)
    if kept is None:
        raise HttpError.invalid(
            "conversation",
            f"{conversation_id!r} is not a conversation of this tenant (never made, deleted, or "
            "dropped from the router's store)",
        )
    return kept


def extend(
    store: ConversationStore,
    tenant: str,
    conversation_id: str,
    inputs: list[Item],
    answered: Response,
    dropped: int = 0,
) -> None:
    """Add a response's input and output items to its conversation as it ends: completed, or
    incomplete (a failed or cancelled one adds nothing); `dropped`: its truncation's cut."""
    if answered.status not in ("completed", "incomplete"):
        return
    kept = store.get(tenant, conversation_id)  # as it is now: items may have come meanwhile
    if kept is None:
        log.warning("conversation %s went before response %s ended", conversation_id, answered.id)
        return
    outputs = [as_turn(item.model_dump()) for item in answered.output]
    if not store.add(tenant, kept, [*inputs, *outputs], dropped):
        log.warning(
            "conversation %s: response %s's items not added (router.response_store_bytes)",
            conversation_id,
            answered.id,
        )


def add_routes(app: FastAPI, api: HttpApi) -> None:
    _conversation_routes(app, api)
    _item_routes(app, api)


def _conversation_routes(app: FastAPI, api: HttpApi) -> None:
    store = api.conversations

    async def create(body: CreateConversation, request: Request) -> HttpResponse:
        who = _tenant(api, request)
        check_metadata(body.metadata)
        items = checked_items(body.items or [], "items")
        made = Conversation(f"conv_{uuid.uuid4().hex}", int(time.time()), body.metadata or {})
        if not store.add(who, made, items):
            raise _too_large()
        return _answer(made.shown())

    async def retrieve(conversation_id: str, request: Request) -> HttpResponse:
        return _answer(_found(api, _tenant(api, request), conversation_id).shown())

    async def update(
        conversation_id: str, body: UpdateConversation, request: Request
    ) -> HttpResponse:
        who = _tenant(api, request)
        kept = _found(api, who, conversation_id)
        check_metadata(body.metadata)
        relabelled = replace(kept, metadata=body.metadata or {})
        if not store.keep(who, relabelled):
            raise _too_large("metadata")
        return _answer(relabelled.shown())

    async def delete(conversation_id: str, request: Request) -> HttpResponse:
        who = _tenant(api, request)
        _found(api, who, conversation_id)
        store.delete(who, conversation_id)
        return _answer({"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    path = "/v1/conversations"
    app.add_api_route(path, create, methods=["POST"])
    app.add_api_route(path + "/{conversation_id}", retrieve, methods=["GET"])
    app.add_api_route(path + "/{conversation_id}", update, methods=["POST"])
    app.add_api_route(path + "/{conversation_id}", delete, methods=["DELETE"])


def _item_routes(app: FastAPI, api: HttpApi) -> None:
    store = api.conversations

    async def add_items(conversation_id: str, body: AddItems, request: Request) -> HttpResponse:
        who = _tenant(api, request)
        kept = _found(api, who, conversation_id)
        items = checked_items(body.items, "items", kept.ids)
        if not store.add(who, kept, items, kept.dropped):
            raise _too_large()
        first, last = (items[0]["id"], items[-1]["id"]) if items else (None, None)
        listing = {"object": "list", "data": items, "first_id": first, "last_id": last}
        return _answer(listing | {"has_more": False})

    async def list_items(conversation_id: str, request: Request) -> HttpResponse:
        kept = _found(api, _tenant(api, request), conversation_id)
        page = page_of(kept.ids, request.query_params, "desc", "an item of this conversation")
        return _answer(page | {"data": [json.loads(kept.items[k]) for k in page["data"]]})

    async def retrieve_item(conversation_id: str, item_id: str, request: Request) -> HttpResponse:
        kept = _found(api, _tenant(api, request), conversation_id)
        k = _item(kept, item_id)
        return HttpResponse(kept.items[k], media_type="application/json")

    async def delete_item(conversation_id: str, item_id: str, request: Request) -> HttpResponse:
        who = _tenant(api, request)
        kept = _found(api, who, conversation_id)
        k = _item(kept, item_id)
        items, ids = kept.items[:k] + kept.items[k + 1 :], kept.ids[:k] + kept.ids[k + 1 :]
        store.keep(who, replace(kept, items=items, ids=ids, dropped=0))  # smaller: it fits
        return _answer(kept.shown())

    path = "/v1/conversations/{conversation_id}/items"
    app.add_api_route(path, add_items, methods=["POST"])
    app.add_api_route(path, list_items, methods=["GET"])
    app.add_api_route(path + "/{item_id}", retrieve_item, methods=["GET"])
    app.add_api_route(path + "/{item_id}", delete_item, methods=["DELETE"])


def _tenant(api: HttpApi, request: Request) -> str:
    who = owner(api.caller(request), api.tenant(request))  # 401 first
    if not api.conversations.enabled:
        raise HttpError(
            404, "this router keeps no conversations (router.response_store_bytes is 0)"
        )
    return who


def _found(api: HttpApi, tenant: str, conversation_id: str) -> Conversation:
    kept = api.conversations.get(tenant, conversation_id)
    if kept is None:
        raise HttpError(
            404,
            f"no conversation {conversation_id!r} (never made, deleted, or dropped from the "
            "router's store)",
            "conversation_id",
        )
    return kept


def _item(conversation: Conversation, item_id: str) -> int:
    if item_id not in conversation.ids:
        raise HttpError(404, f"no item {item_id!r} in {conversation.id!r}", "item_id")
    return conversation.ids.index(item_id)


def _answer(body: dict[str, Any]) -> HttpResponse:
    return HttpResponse(json.dumps(body), media_type="application/json")


def _too_large(param: str = "items") -> HttpError:
    return HttpError.invalid(
        param,
        "the conversation would be larger than the router keeps (router.response_store_bytes)",
    )
