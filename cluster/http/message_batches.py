"""Anthropic's Message Batches API, as the `anthropic` SDK calls it (`client.messages.batches`):

    POST   /v1/messages/batches                 `requests`: [{custom_id, params}], run at once
    GET    /v1/messages/batches                 the caller's, most recent first (`before_id`,
                                                `after_id`, `limit`)
    GET    /v1/messages/batches/{id}            one, as it stands
    POST   /v1/messages/batches/{id}/cancel
    DELETE /v1/messages/batches/{id}            an ended one, with its results
    GET    /v1/messages/batches/{id}/results    JSON Lines, once it ended (`results_url`)

A Message Batch is one of OpenAI's batches (cluster/http/batches.py) over POST /v1/messages,
shown as Anthropic shows it: its requests are sent to this router's own /v1/messages with the
creator's credentials, in the order that reuses the cache (`router.batch_order`), within
`router.batch_max_in_flight` together with OpenAI's batches, at `router.batch_priority` under
the `priority` scheduling policy; it is cancelled, drained, and (with `router.state_dir`)
outlives a restart as they do. Its requests and its results are kept as files that count
against `router.files_bytes` and that the Files API does not show, forgotten with the batch
(deleted, or the oldest past the ended batches kept); without files (the bound 0) this API is
404, as the Batch API is. The body of a create may be as large as an upload to /v1/files.

The requests are checked when the batch is created: at least one, at most 100,000 (Anthropic's
limits), each an object of a `custom_id` (1-64 letters, digits, `-` or `_`, unique in the batch)
and `params` that do not stream; a refusal names the request (`requests[3].custom_id`). What
`params` ask is checked when the request runs, by /v1/messages itself, as Anthropic does: a
refusal is that request's `errored` result, with the error body /v1/messages answered.

Counts: every request is `processing` until the batch ends, then `succeeded`, `errored`, or
`canceled` (cancelled or drained before it ran); nothing expires. The results file holds one
line a request in the order sent.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from cluster.http.batch_runner import CREDENTIALS
from cluster.http.batch_schema import MAX_MESSAGE_REQUESTS, MESSAGES, Batch, BatchLine
from cluster.http.batches import ENDED
from cluster.http.errors import HttpError
from cluster.http.list_places import ListPlaces, past
from cluster.http.openai_schema import Body
from cluster.http.responses_chain import owner

if TYPE_CHECKING:
    from cluster.http.app import HttpApi

CUSTOM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""What Anthropic allows a request's `custom_id` to be."""
MAX_PAGE = 1000
"""The most batches a list answers with (Anthropic's)."""
REFUSED_PARAMS = {
    "stream": "a batch request cannot stream",
    "background": "a batch request cannot run in the background",
}
"""What a request's `params` may not ask for (the batch's input file's rules, batch_schema)."""


class BatchRequest(Body):
    requests: list[dict[str, Any]]


class RequestCounts(BaseModel):
    processing: int = 0
    succeeded: int = 0
    errored: int = 0
    canceled: int = 0
    expired: int = 0


class MessageBatch(BaseModel):
    """Anthropic's `MessageBatch`."""

    id: str
    type: Literal["message_batch"] = "message_batch"
    processing_status: Literal["in_progress", "canceling", "ended"]
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    created_at: str
    expires_at: str
    ended_at: str | None = None
    cancel_initiated_at: str | None = None
    archived_at: str | None = None
    results_url: str | None = None


def requests_file(requests: list[dict[str, Any]]) -> tuple[bytes, list[BatchLine]]:
    """The batch's requests as an input file's lines for /v1/messages, and as the lines read
    from it; 400 naming the first request at fault."""
    if not 1 <= len(requests) <= MAX_MESSAGE_REQUESTS:
        raise HttpError.invalid(
            "requests", f"holds {len(requests)} requests; from 1 to {MAX_MESSAGE_REQUESTS}"
        )
    seen: dict[str, int] = {}
    lines, read = [], []
    for i, item in enumerate(requests):
        where = f"requests[{i}]"
        unknown = sorted(set(item) - {"custom_id", "params"})
        if unknown:
            raise HttpError.invalid(f"{where}.{unknown[0]}", "is not a field of a request")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
            raise HttpError.invalid(
                f"{where}.custom_id", "must be 1-64 letters, digits, '-' or '_'"
            )
        if custom_id in seen:
            raise HttpError.invalid(
                f"{where}.custom_id", f"{custom_id!r} is requests[{seen[custom_id]}]'s too"
            )
        seen[custom_id] = i
        params = item.get("params")
        if not isinstance(params, dict):
            raise HttpError.invalid(f"{where}.params", "must be an object of Messages parameters")
        for name, why in REFUSED_PARAMS.items():  # read_lines' rules, named here by request
            if params.get(name):
                raise HttpError.invalid(f"{where}.params.{name}", why)
        line = {"custom_id": custom_id, "method": "POST", "url": MESSAGES, "body": params}
        lines.append(json.dumps(line, ensure_ascii=False) + "\n")
        read.append(BatchLine(i + 1, custom_id, params))
    return "".join(lines).encode(), read


def shown(batch: Batch) -> MessageBatch:
    """The batch as Anthropic shows it. Its `results_url` is a path, which the SDK reads from
    the address it calls (an absolute URL built from the request would name the address
    behind a proxy that ends TLS, or lose the path a gateway routes by)."""
    status = {"cancelling": "canceling", "in_progress": "in_progress", "finalizing": "in_progress"}
    counts = batch.request_counts
    view = MessageBatch(
        id=batch.id,
        processing_status=status.get(batch.status, "ended"),  # type: ignore[arg-type]
        created_at=_rfc3339(batch.created_at),
        expires_at=_rfc3339(batch.expires_at or batch.created_at),
    )
    if batch.cancelling_at is not None:
        view.cancel_initiated_at = _rfc3339(batch.cancelling_at)
    if view.processing_status != "ended":
        view.request_counts.processing = counts.total
        return view
    view.ended_at = _rfc3339(batch.completed_at or batch.cancelled_at or batch.failed_at or 0)
    view.results_url = f"/v1/messages/batches/{batch.id}/results"
    if batch.status == "failed":  # its requests could not be read: none ran
        view.request_counts.errored = counts.total
        return view
    view.request_counts.succeeded = counts.completed
    view.request_counts.errored = counts.failed
    view.request_counts.canceled = counts.total - counts.completed - counts.failed
    return view


def results(requests: bytes, answers: list[bytes]) -> bytes:
    """The results file: a line for each request, in the order sent, from the batch's output
    and error files (`answers`); a request with no answer was canceled."""
    found: dict[str, dict[str, Any]] = {}
    for content in answers:
        for raw in content.decode().split("\n"):
            if raw:
                answer = json.loads(raw)
                found[answer["custom_id"]] = answer
    lines = []
    for raw in requests.decode().split("\n"):
        if raw:
            custom_id = json.loads(raw)["custom_id"]
            result = _result(found.get(custom_id))
            lines.append(json.dumps({"custom_id": custom_id, "result": result}) + "\n")
    return "".join(lines).encode()


def _result(answer: dict[str, Any] | None) -> dict[str, Any]:
    if answer is None:
        return {"type": "canceled"}
    response = answer["response"]
    if response is not None and response["status_code"] == 200:
        return {"type": "succeeded", "message": response["body"]}
    body = response["body"] if response is not None else None
    if not (isinstance(body, dict) and body.get("type") == "error"):
        message = answer["error"]["message"] if answer.get("error") else json.dumps(body)
        body = {"type": "error", "error": {"type": "api_error", "message": message}}
    return {"type": "errored", "error": body}


def _rfc3339(stamp: int) -> str:
    return datetime.fromtimestamp(stamp, UTC).isoformat().replace("+00:00", "Z")


def add_routes(app: FastAPI, api: HttpApi) -> None:
    batches = api.batches

    def tenant(request: Request) -> str:
        return owner(api.caller(request), api.tenant(request))

    def answer(batch: Batch, request: Request) -> Response:
        view = shown(batch)
        return Response(view.model_dump_json(), media_type="application/json")

    async def create(body: BatchRequest, request: Request) -> Response:
        who = tenant(request)
        batches.files.require()
        content, lines = await asyncio.to_thread(requests_file, body.requests)  # up to 200 MiB
        headers = {k: v for k in CREDENTIALS if (v := request.headers.get(k)) is not None}
        headers["x-radixmesh-tenant"] = who
        return answer(await batches.create_messages(who, headers, content, lines), request)

    async def listed(request: Request) -> Response:
        query = request.query_params
        mine = batches.listed(tenant(request), messages=True)
        limit = _limit(query.get("limit"))
        place_of = partial(_place, batches.places, tenant(request))
        page, more = _page(mine, query.get("before_id"), query.get("after_id"), limit, place_of)
        data = [shown(batch).model_dump() for batch in page]
        first, last = (page[0].id, page[-1].id) if page else (None, None)
        listing = {"data": data, "has_more": more, "first_id": first, "last_id": last}
        return Response(json.dumps(listing), media_type="application/json")

    async def retrieve(message_batch_id: str, request: Request) -> Response:
        return answer(batches.get(tenant(request), message_batch_id, messages=True), request)

    async def cancel(message_batch_id: str, request: Request) -> Response:
        batch = await batches.cancel(tenant(request), message_batch_id, messages=True)
        return answer(batch, request)

    async def delete(message_batch_id: str, request: Request) -> Response:
        batches.delete(tenant(request), message_batch_id)
        gone = {"id": message_batch_id, "type": "message_batch_deleted"}
        return Response(json.dumps(gone), media_type="application/json")

    async def read_results(message_batch_id: str, request: Request) -> Response:
        who = tenant(request)
        batch = batches.get(who, message_batch_id, messages=True)
        if batch.status not in ENDED:
            raise HttpError.invalid(
                "message_batch_id", f"batch {message_batch_id!r} is still processing"
            )
        files = [batch.input_file_id, batch.output_file_id, batch.error_file_id]
        kept = [None if f is None else batches.files.find(who, f) for f in files]
        requests = kept[0].content if kept[0] is not None else b""
        answers = [k.content for k in kept[1:] if k is not None]
        content = await asyncio.to_thread(results, requests, answers)  # off the streams' loop
        return Response(content, media_type="application/binary")

    path = "/v1/messages/batches"
    app.add_api_route(path, create, methods=["POST"])
    app.add_api_route(path, listed, methods=["GET"])
    app.add_api_route(path + "/{message_batch_id}", retrieve, methods=["GET"])
    app.add_api_route(path + "/{message_batch_id}", delete, methods=["DELETE"])
    app.add_api_route(path + "/{message_batch_id}/cancel", cancel, methods=["POST"])
    app.add_api_route(path + "/{message_batch_id}/results", read_results, methods=["GET"])


def _limit(given: str | None) -> int:
    if given is None:
        return 20
    if not given.isdigit() or not 1 <= int(given) <= MAX_PAGE:
        raise HttpError.invalid(
            "limit", f"must be a whole number in [1, {MAX_PAGE}], got {given!r}"
        )
    return int(given)


def _place(places: ListPlaces, tenant: str, batch_id: str) -> int | None:
    """A Message Batch's place (none for an id of OpenAI's batches, listed apart)."""
    return places.place(tenant, batch_id) if batch_id.startswith("msgbatch_") else None


def _page(
    batches: list[Batch],
    before: str | None,
    after: str | None,
    limit: int,
    place_of: Callable[[str], int | None],
) -> tuple[list[Batch], bool]:
    """Anthropic's paging of a list, most recent first: the `limit` batches right after the
    one `after_id` names (older), or right before the one `before_id` names (newer), or the
    first `limit`; and whether more lie that way. The batch named may have been deleted
    meanwhile (cluster/http/list_places.py)."""
    if before is not None and after is not None:
        raise HttpError.invalid("before_id", "cannot be given with after_id")
    if before is not None:
        newer = past(batches, "before_id", before, place_of, newer=True)
        return newer[-limit:], len(newer) > limit
    if after is not None:
        batches = past(batches, "after_id", after, place_of, newer=False)
    return batches[:limit], len(batches) > limit
