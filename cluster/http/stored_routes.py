"""The stored responses of the Responses API (cluster/http/response_store.py), by id:

    GET    /v1/responses/{id}               the response, as answered (or as it stands);
                                            ?stream=true[&starting_after=N]: a background
                                            response's events, resumed after event N
    DELETE /v1/responses/{id}
    GET    /v1/responses/{id}/input_items   its input items (order, after, limit)
    POST   /v1/responses/{id}/cancel        a background response's generation

Each is the caller's tenant's (cluster/http/responses_chain.py `owner`): another's id is 404,
as one never stored.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response as HttpResponse

from cluster.http.errors import HttpError
from cluster.http.event_log import EventLog
from cluster.http.response_store import StoredResponse
from cluster.http.responses_chain import owner
from cluster.http.sse import EventStream

if TYPE_CHECKING:
    from cluster.http.app import HttpApi


def add_routes(app: FastAPI, api: HttpApi) -> None:
    async def retrieve(response_id: str, request: Request) -> HttpResponse:
        kept = _stored(response_id, request)
        if request.query_params.get("stream", "false") == "false":
            return HttpResponse(kept.response, media_type="application/json")
        tenant = owner(api.caller(request), api.tenant(request))
        # not a foreground response that took an ended background one's id
        written = api.background.events(tenant, response_id) if kept.background else None
        return _resumed(written, request.query_params)

    async def delete(response_id: str, request: Request) -> HttpResponse:
        tenant = owner(api.caller(request), api.tenant(request))
        await api.background.cancel(tenant, response_id)  # else it would store it again
        api.background.drop(tenant, response_id)
        if not api.responses.delete(tenant, response_id):
            raise _not_stored(response_id)
        gone = {"id": response_id, "object": "response", "deleted": True}
        return HttpResponse(json.dumps(gone), media_type="application/json")

    async def input_items(response_id: str, request: Request) -> HttpResponse:
        kept = _stored(response_id, request)
        return HttpResponse(
            json.dumps(item_page(StoredResponse.decoded(kept.inputs), request.query_params)),
            media_type="application/json",
        )

    async def cancel(response_id: str, request: Request) -> HttpResponse:
        tenant = owner(api.caller(request), api.tenant(request))
        if not await api.background.cancel(tenant, response_id):
            kept = _stored(response_id, request)
            if not kept.background:
                raise HttpError.invalid(
                    "response_id", f"{response_id!r} is not a background response"
                )  # a finished background one is answered as it is: cancelling it again is fine
        return HttpResponse(_stored(response_id, request).response, media_type="application/json")

    def _stored(response_id: str, request: Request) -> StoredResponse:
        tenant = owner(api.caller(request), api.tenant(request))
        kept = api.responses.get(tenant, response_id)
        if kept is None:
            raise _not_stored(response_id)
        return kept

    app.add_api_route("/v1/responses/{response_id}", retrieve, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete, methods=["DELETE"])
    app.add_api_route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"])


def _resumed(written: EventLog | None, query: Mapping[str, str]) -> EventStream:
    """A background response's events after `starting_after` (from the first without it)."""
    if query["stream"] != "true":
        raise HttpError.invalid("stream", "true or false")
    if written is None:
        raise HttpError.invalid(
            "stream",
            "only a background response created with stream: true keeps its events (while it "
            "runs, and for a while after it ended): retrieve it whole",
        )
    raw = query.get("starting_after", "-1")
    if raw != "-1" and not (raw.isascii() and raw.isdigit()):
        raise HttpError.invalid("starting_after", f"{raw!r}: an event's sequence_number, from 0")
    if written.closed and int(raw) >= len(written.events):
        raise HttpError.invalid(
            "starting_after", f"{raw}: the response ended at event {len(written.events) - 1}"
        )
    return EventStream(written.follow(int(raw)))


def _not_stored(response_id: str) -> HttpError:
    return HttpError(
        404,
        f"response {response_id!r} is not stored for this tenant (never stored, deleted, or "
        "dropped from the router's store)",
    )


def item_page(items: Sequence[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """A page of a stored response's input items, as OpenAI lists them (`page_of`; newest
    first unless `order` says asc)."""
    page = page_of([item["id"] for item in items], query, "desc", "an input item of this response")
    return page | {"data": [items[k] for k in page["data"]]}


def page_of(
    ids: Sequence[str],
    query: Mapping[str, str],
    order_default: str,
    what: str,
    places: Sequence[int] | None = None,
    place_of: Callable[[str], int | None] | None = None,
) -> dict[str, Any]:
    """A page of a list, as OpenAI pages one, with the listed places in `ids` as its `data`:
    `order` asc (`ids`' order) or desc, after the id `after` names (`what` it should be: its
    refusal says), at most `limit` (1-100, 20). `places`: where each id is in the order of the
    whole list (ascending; by default its index), and `place_of` an id's place, one no longer
    in `ids` too (by default the place of the first of `ids` listed that is the id)."""
    order = query.get("order", order_default)
    if order not in ("asc", "desc"):
        raise HttpError.invalid("order", f"{order!r} is not one of asc, desc")
    raw = query.get("limit", "20")
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_PAGE:
        raise HttpError.invalid("limit", f"{raw!r}: a whole number from 1 to {MAX_PAGE}")
    where = list(range(len(ids))) if places is None else list(places)
    listed = sorted(range(len(ids)), key=where.__getitem__, reverse=order == "desc")
    after = query.get("after")
    if after is not None:
        at = (
            place_of(after)
            if place_of is not None
            else next((where[k] for k in listed if ids[k] == after), None)
        )
        if at is None:
            raise HttpError.invalid("after", f"{after!r} is not {what}")
        listed = [k for k in listed if (where[k] > at if order == "asc" else where[k] < at)]
    page = listed[: int(raw)]
    return {
        "object": "list",
        "data": page,
        "first_id": ids[page[0]] if page else None,
        "last_id": ids[page[-1]] if page else None,
        "has_more": len(listed) > len(page),
    }


MAX_PAGE = 100
"""The most one page lists (OpenAI's bound)."""
