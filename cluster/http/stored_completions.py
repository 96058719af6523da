"""Stored chat completions: OpenAI's `store: true` on `POST /v1/chat/completions`, and the
routes that read them back (the SDKs' `chat.completions.list / retrieve / update / delete` and
`chat.completions.messages.list`):

    GET    /v1/chat/completions                  the tenant's, oldest first (`order`), filtered
                                                 by `model` and `metadata[key]=value`; a page
                                                 (`after`, `limit` 1-100, 20)
    GET    /v1/chat/completions/{id}             one, as answered, with its request's
                                                 `metadata` and sampling parameters
    POST   /v1/chat/completions/{id}             its `metadata` replaced (the only change)
    DELETE /v1/chat/completions/{id}
    GET    /v1/chat/completions/{id}/messages    its request's messages, each with an id

A completion is kept as answered, streamed or not, once it ended (one that failed or whose client
went away is not kept), in the router's memory within `router.response_store_bytes` (a store apart
from the Responses API's, with the same bound), the largest tenant's least recently used dropped
first; with `router.state_dir` they outlive a restart (cluster/http/kept_files.py), without it
not. Each is its tenant's (responses_chain.py `owner`): another's id
is 404, as one never stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response as HttpResponse
from pydantic import BaseModel

from cluster.http.errors import HttpError
from cluster.http.kept_files import json_text
from cluster.http.kept_store import KeptStore
from cluster.http.list_places import ListPlaces
from cluster.http.openai_responses import FINISH_ERROR, Counts, Responses, Sample
from cluster.http.openai_schema import ChatCompletionRequest, ChatMessage, Strict
from cluster.http.responses_chain import check_metadata, owner
from cluster.http.stored_routes import page_of
from worker.request import FINISH_ABORT

if TYPE_CHECKING:
    from cluster.http.app import HttpApi

ENTRY_BYTES = 640
"""What Python takes to hold one stored completion beside its bytes (response_store.py's
measure: the key, the entry, the dataclass, a bytes object)."""
ITEM_BYTES = 64
"""Beside each message's bytes."""
PARAMETERS = (
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "tools",
    "tool_choice",
    "response_format",
)
"""The request's parameters a stored completion shows beside its `metadata` (null: not set)."""
Keep = Callable[[BaseModel], Awaitable[None]]
"""Keeps a whole response (cluster/http/app.py `respond`)."""


@dataclass(frozen=True, slots=True)
class StoredCompletion:
    key: str
    """The completion's id."""
    completion: bytes
    """The completion object as answered, with the request's parameters, less `metadata`."""
    messages: tuple[bytes, ...]
    """The request's messages, each with its id."""
    model: str
    sequence: int
    """Its place in the listing: the order the requests came in (`next_place`)."""
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def size(self) -> int:
        metadata = sum(len(k) + len(v) for k, v in self.metadata.items())
        kept = len(self.completion) + sum(map(len, self.messages)) + metadata
        return kept + ENTRY_BYTES + ITEM_BYTES * len(self.messages)

    def shown(self) -> dict[str, Any]:
        """The completion object a read returns."""
        return json.loads(self.completion) | {"metadata": self.metadata}


class CompletionStore(KeptStore[StoredCompletion]):
    """The stored chat completions, by (tenant, id); and the places in the listing of those
    deleted or dropped last (cluster/http/list_places.py), so that a listing paged after one of
    them goes on (a client deleting what it lists, page by page, names a deleted one in
    `after`)."""

    def __init__(self, max_bytes: int, directory: Path | None = None) -> None:
        self._places = 0
        """The next request's place in the listing (`next_place`)."""
        self._listed = ListPlaces()
        """Each completion's place (its `sequence`), and those of the last gone."""
        super().__init__(max_bytes, directory)

    def put(self, tenant: str, key: str, value: StoredCompletion) -> bool:
        if not super().put(tenant, key, value):
            return False
        self._listed.add(tenant, key, value.sequence)
        return True

    def gone(self, tenant: str, key: str, value: StoredCompletion) -> None:
        self._listed.remove(tenant, key)

    def next_place(self) -> int:
        """A request's place in the listing, drawn as it comes in (as OpenAI lists by
        `created`)."""
        self._places += 1
        return self._places - 1

    def place(self, tenant: str, key: str) -> int | None:
        """The completion's place in the listing, kept or recently gone (None: unknown)."""
        return self._listed.place(tenant, key)

    def saved(self, value: StoredCompletion) -> dict[str, Any]:
        return {
            "completion": value.completion.decode(),
            "messages": [message.decode() for message in value.messages],
            "model": value.model,
            "sequence": value.sequence,
            "metadata": value.metadata,
        }

    def restored(self, saved: dict[str, Any]) -> StoredCompletion:
        """As saved; the places drawn from now on follow its place (`next_place`)."""
        completion = json_text(saved["completion"])
        metadata = saved["metadata"]
        if not all(isinstance(v, str) for v in metadata.values()):
            raise TypeError("metadata values are not all strings")
        restored = StoredCompletion(
            key=str(json.loads(completion)["id"]),
            completion=completion,
            messages=tuple(map(json_text, saved["messages"])),
            model=str(saved["model"]),
            sequence=int(saved["sequence"]),
            metadata=dict(metadata),
        )
        self._places = max(self._places, restored.sequence + 1)  # drawn from past it on
        return restored


class MetadataUpdate(Strict):
    """`POST /v1/chat/completions/{id}`: the metadata that replaces the completion's (null:
    none)."""

    metadata: dict[str, str] | None


def storing(body: ChatCompletionRequest, store: CompletionStore) -> bool:
    """Whether the completion will be kept (`store: true`, off by default as OpenAI's is);
    refused when the router keeps none, and bad metadata is refused either way."""
    check_metadata(body.metadata)
    if body.store and not store.enabled:
        raise HttpError.invalid(
            "store", "this router keeps no chat completions (router.response_store_bytes is 0)"
        )
    return bool(body.store)


def kept(body: ChatCompletionRequest, completion: BaseModel, place: int) -> StoredCompletion:
    """What the store keeps of an answered request (`place`: from `next_place`)."""
    answered = completion.model_dump(mode="json")
    asked = body.model_dump(mode="json", by_alias=True, include=set(PARAMETERS))
    shown = answered | {name: asked.get(name) for name in PARAMETERS}
    return StoredCompletion(
        key=answered["id"],
        completion=json.dumps(shown).encode(),
        messages=tuple(
            json.dumps(_message(f"{answered['id']}-{k}", m)).encode()
            for k, m in enumerate(body.messages)
        ),
        model=answered["model"],
        metadata=dict(body.metadata or {}),
        sequence=place,
    )


def answered_whole(samples: Mapping[int, Sample]) -> bool:
    """Whether every sample ended as a generation does (not failed, nor aborted: those are
    not kept)."""
    return all(s.finish_reason not in (FINISH_ERROR, FINISH_ABORT) for s in samples.values())


async def kept_at_the_end(
    stream: Responses,
    whole: Callable[[dict[int, Sample], Counts], BaseModel],
    keep: Keep,
    large: bool,
) -> Responses:
    """The stream, passed on as it comes; once it ended, the whole response built from what it
    carried is kept (not when it failed, or its client went away: it is then closed first)."""
    samples: dict[int, Sample] = {}
    counts = Counts()
    async with contextlib.aclosing(stream):
        async for response in stream:
            counts.record(response)
            samples.setdefault(response.index, Sample()).take(response)
            yield response
    if not answered_whole(samples):
        return
    built = await asyncio.to_thread(whole, samples, counts) if large else whole(samples, counts)
    await keep(built)


def _message(message_id: str, message: ChatMessage) -> dict[str, Any]:
    """A request's message as OpenAI lists a stored one: its text in `content`, and when it
    has parts other than text (images), every part in `content_parts`."""
    shown = message.model_dump(mode="json", exclude_none=True)
    parts = message.content
    if isinstance(parts, list):
        texts = [part.get("text") for part in parts if part.get("type") == "text"]
        shown["content"] = "".join(t for t in texts if isinstance(t, str)) if texts else None
        if len(texts) < len(parts):
            shown["content_parts"] = parts
    return {"id": message_id, **shown}


def add_routes(app: FastAPI, api: HttpApi) -> None:
    def tenant_of(request: Request) -> str:
        return owner(api.caller(request), api.tenant(request))

    def stored(completion_id: str, request: Request) -> StoredCompletion:
        kept = api.chat_store.get(tenant_of(request), completion_id)
        if kept is None:
            raise HttpError(
                404,
                f"chat completion {completion_id!r} is not stored for this tenant (never "
                "stored, deleted, or dropped from the router's store)",
                "completion_id",
            )
        return kept

    async def listing(request: Request) -> HttpResponse:
        tenant = tenant_of(request)
        query = request.query_params
        wanted = _metadata_filter(query)
        model = query.get("model")
        rows = [
            (key, value)
            for key, value in sorted(api.chat_store.of(tenant), key=lambda kv: kv[1].sequence)
            if (model is None or value.model == model)
            and all(value.metadata.get(k) == v for k, v in wanted.items())
        ]
        page = page_of(
            [key for key, _ in rows],
            query,
            "asc",
            "a stored completion of this tenant",
            places=[value.sequence for _, value in rows],
            place_of=lambda key: api.chat_store.place(tenant, key),
        )
        return _json(page | {"data": [rows[k][1].shown() for k in page["data"]]})

    async def retrieve(completion_id: str, request: Request) -> HttpResponse:
        return _json(stored(completion_id, request).shown())

    async def update(completion_id: str, body: MetadataUpdate, request: Request) -> HttpResponse:
        check_metadata(body.metadata)
        tenant = tenant_of(request)
        changed = replace(stored(completion_id, request), metadata=dict(body.metadata or {}))
        if changed.size > api.chat_store.max_bytes:  # refused before `put` drops the old one
            raise HttpError(413, "the metadata makes the completion larger than the store")
        api.chat_store.put(tenant, completion_id, changed)
        return _json(changed.shown())

    async def delete(completion_id: str, request: Request) -> HttpResponse:
        stored(completion_id, request)
        api.chat_store.delete(tenant_of(request), completion_id)
        gone = {"object": "chat.completion.deleted", "id": completion_id, "deleted": True}
        return _json(gone)

    async def messages(completion_id: str, request: Request) -> HttpResponse:
        _refuse_others(request.query_params, PAGE_QUERY)
        items = [json.loads(m) for m in stored(completion_id, request).messages]
        ids = [item["id"] for item in items]
        page = page_of(ids, request.query_params, "asc", "a message of this completion")
        return _json(page | {"data": [items[k] for k in page["data"]]})

    app.add_api_route("/v1/chat/completions", listing, methods=["GET"])
    app.add_api_route("/v1/chat/completions/{completion_id}", retrieve, methods=["GET"])
    app.add_api_route("/v1/chat/completions/{completion_id}", update, methods=["POST"])
    app.add_api_route("/v1/chat/completions/{completion_id}", delete, methods=["DELETE"])
    app.add_api_route("/v1/chat/completions/{completion_id}/messages", messages, methods=["GET"])


PAGE_QUERY = ("after", "limit", "order")
LISTING_QUERY = (*PAGE_QUERY, "model")


def _metadata_filter(query: Mapping[str, str]) -> dict[str, str]:
    """`metadata[key]=value` pairs of a listing's query (the SDKs' way of writing its
    `metadata`); any other parameter is refused by name."""
    wanted = {}
    for name, value in query.items():
        if name.startswith("metadata[") and name.endswith("]") and len(name) > len("metadata[]"):
            wanted[name[len("metadata[") : -1]] = value
        elif name not in LISTING_QUERY:
            raise HttpError.invalid(name, "unknown query parameter")
    return wanted


def _refuse_others(query: Mapping[str, str], known: tuple[str, ...]) -> None:
    for name in query:
        if name not in known:
            raise HttpError.invalid(name, "unknown query parameter")


def _json(value: dict[str, Any]) -> HttpResponse:
    return HttpResponse(json.dumps(value), media_type="application/json")
