"""OpenAI's Files and Batch APIs, as the `openai` SDK calls them (`client.files`,
`client.batches`):

    POST   /v1/files                    upload (multipart: `file`, `purpose: batch`)
    GET    /v1/files                    the caller's files (`purpose`, `order`, `after`, `limit`)
    GET    /v1/files/{id}               one
    GET    /v1/files/{id}/content       its bytes
    DELETE /v1/files/{id}
    POST   /v1/batches                  run a file's requests (cluster/http/batches.py)
    GET    /v1/batches                  the caller's batches, most recent first (`after`, `limit`)
    GET    /v1/batches/{id}             one, as it stands
    POST   /v1/batches/{id}/cancel

Each file and batch is its tenant's (cluster/http/responses_chain.py `owner`): another's id is
404, as one never kept.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Form, Request, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel

from cluster.http.batch_runner import CREDENTIALS
from cluster.http.batch_schema import BatchCreateRequest
from cluster.http.batches import INPUT_PURPOSE
from cluster.http.errors import HttpError
from cluster.http.file_store import StoredFile
from cluster.http.list_places import ListPlaces, past
from cluster.http.responses_chain import check_metadata, owner

if TYPE_CHECKING:
    from cluster.http.app import HttpApi

UPLOAD_PURPOSES = ("batch",)
"""What this router keeps files for."""
MAX_PAGE = 10_000
"""The most files a list answers with (OpenAI's)."""


def add_routes(app: FastAPI, api: HttpApi) -> None:
    _file_routes(app, api)
    _batch_routes(app, api)


def _file_routes(app: FastAPI, api: HttpApi) -> None:
    async def upload(request: Request, file: UploadFile, purpose: str = Form()) -> Response:
        tenant = _tenant(api, request)
        if purpose not in UPLOAD_PURPOSES:
            raise HttpError.invalid("purpose", f"must be one of {list(UPLOAD_PURPOSES)}")
        content = await file.read()
        card = api.files.upload(tenant, file.filename or "upload", purpose, content)
        await api.files.save(tenant, card.id)
        return _json(card)

    async def list_files(request: Request) -> Response:
        query = request.query_params
        tenant = _tenant(api, request)
        cards = api.files.cards(tenant, query.get("purpose"))
        cards = [card for card in cards if card.purpose != INPUT_PURPOSE]
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise HttpError.invalid("order", f"must be 'asc' or 'desc', got {order!r}")
        if order == "desc":
            cards.reverse()
        limit = _limit(query.get("limit"), MAX_PAGE, MAX_PAGE)
        if (after := query.get("after")) is not None:
            place_of = partial(api.files.places.place, tenant)
            cards = past(cards, "after", after, place_of, newer=order == "asc")
        return _listed(cards[:limit], len(cards) > limit)

    async def retrieve_file(file_id: str, request: Request) -> Response:
        return _json(_file(api, _tenant(api, request), file_id).card)

    async def file_content(file_id: str, request: Request) -> Response:
        found = _file(api, _tenant(api, request), file_id)
        return Response(found.content, media_type="application/octet-stream")

    async def delete_file(file_id: str, request: Request) -> Response:
        tenant = _tenant(api, request)
        _file(api, tenant, file_id)  # 404 first
        reader = api.batches.reading(tenant, file_id)
        if reader is not None:  # its lines are read from it again should the router restart
            raise HttpError(
                409, f"batch {reader!r} still runs the requests of {file_id!r}: cancel it first"
            )
        api.files.delete(tenant, file_id)
        return _raw({"id": file_id, "object": "file", "deleted": True})

    app.add_api_route("/v1/files", upload, methods=["POST"])
    app.add_api_route("/v1/files", list_files, methods=["GET"])
    app.add_api_route("/v1/files/{file_id}", retrieve_file, methods=["GET"])
    app.add_api_route("/v1/files/{file_id}/content", file_content, methods=["GET"])
    app.add_api_route("/v1/files/{file_id}", delete_file, methods=["DELETE"])


def _batch_routes(app: FastAPI, api: HttpApi) -> None:
    async def create_batch(body: BatchCreateRequest, request: Request) -> Response:
        tenant = _tenant(api, request)
        check_metadata(body.metadata)  # OpenAI's bounds, as on the other routes that keep it
        headers = {k: v for k in CREDENTIALS if (v := request.headers.get(k)) is not None}
        headers["x-radixmesh-tenant"] = tenant
        return _json(await api.batches.create(tenant, headers, body))

    async def list_batches(request: Request) -> Response:
        query, tenant = request.query_params, _tenant(api, request)
        batches = api.batches.listed(tenant)
        limit = _limit(query.get("limit"), 20, 100)
        if (after := query.get("after")) is not None:
            place_of = partial(_openai_place, api.batches.places, tenant)
            batches = past(batches, "after", after, place_of, newer=False)
        return _listed(batches[:limit], len(batches) > limit)

    async def retrieve_batch(batch_id: str, request: Request) -> Response:
        return _json(api.batches.get(_tenant(api, request), batch_id))

    async def cancel_batch(batch_id: str, request: Request) -> Response:
        return _json(await api.batches.cancel(_tenant(api, request), batch_id))

    app.add_api_route("/v1/batches", create_batch, methods=["POST"])
    app.add_api_route("/v1/batches", list_batches, methods=["GET"])
    app.add_api_route("/v1/batches/{batch_id}", retrieve_batch, methods=["GET"])
    app.add_api_route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"])


def _openai_place(places: ListPlaces, tenant: str, batch_id: str) -> int | None:
    """An OpenAI batch's place (none for a Message Batch's id, listed apart)."""
    return None if batch_id.startswith("msgbatch_") else places.place(tenant, batch_id)


def _file(api: HttpApi, tenant: str, file_id: str) -> StoredFile:
    """A file of the Files API's: 404 for one never kept, or an Anthropic batch's."""
    found = api.files.get(tenant, file_id)
    if found.card.purpose == INPUT_PURPOSE:
        raise HttpError(404, f"no file {file_id!r}", "file_id")
    return found


def _tenant(api: HttpApi, request: Request) -> str:
    return owner(api.caller(request), api.tenant(request))


def _limit(given: str | None, default: int, most: int) -> int:
    if given is None:
        return default
    if not given.isdigit() or not 1 <= int(given) <= most:
        raise HttpError.invalid("limit", f"must be a whole number in [1, {most}], got {given!r}")
    return int(given)


def _listed(page: Sequence[BaseModel], more: bool) -> Response:
    data = [item.model_dump() for item in page]
    first, last = (page[0].id, page[-1].id) if page else (None, None)  # type: ignore[attr-defined]
    return _raw(
        {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}
    )


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _raw(body: dict[str, Any]) -> Response:
    return Response(json.dumps(body), media_type="application/json")
