"""A Responses API request against the stored responses (cluster/http/response_store.py): whose
they are, whether it is stored, the stored response it continues, and what storing it keeps.

A response belongs to the tenant that asked for it: the token's tenant, or for a token bound
to every tenant (or none configured) the one `X-Radixmesh-Tenant` names ("" without it). A
tenant sees only its own; another's id is answered as one never stored.
"""

from __future__ import annotations

from cluster.config import ANY_TENANT
from cluster.http.errors import HttpError
from cluster.http.response_store import Item, ResponseStore, StoredResponse
from cluster.http.responses_output import new_item_id
from cluster.http.responses_schema import Response, ResponsesRequest
from cluster.serving_call import Caller

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
UNFINISHED = ("queued", "in_progress")
_ID_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc"}


def owner(caller: Caller, named: str) -> str:
    """The tenant whose responses a caller reads and writes (`named`: the tenant header)."""
    if caller.tenant == ANY_TENANT:
        return named
    if named and named != caller.tenant:
        raise HttpError(403, f"this token may only use tenant {caller.tenant!r}")
    return caller.tenant


def stored(body: ResponsesRequest, store: ResponseStore) -> bool:
    """Whether the response will be stored: unless `store: false`, when the router keeps
    responses; `store: true` is refused when it keeps none."""
    if body.store and not store.enabled:
        raise HttpError.invalid(
            "store",
            "this router keeps no responses (router.response_store_bytes is 0); "
            "send store: false, and the conversation in input",
        )
    check_metadata(body.metadata)
    return body.store is not False and store.enabled


def continued(body: ResponsesRequest, store: ResponseStore, tenant: str) -> StoredResponse | None:
    """The stored response `previous_response_id` names (None: it names none)."""
    if body.previous_response_id is None:
        return None
    if not store.enabled:
        raise HttpError.invalid(
            "previous_response_id",
            "this router keeps no responses (router.response_store_bytes is 0); "
            "send the conversation in input",
        )
    earlier = store.get(tenant, body.previous_response_id)
    if earlier is not None and earlier.in_conversation is not None:
        raise HttpError.invalid(
            "previous_response_id",
            f"{body.previous_response_id!r} was made in conversation "
            f"{earlier.in_conversation!r}: continue that conversation instead",
        )
    if earlier is not None and earlier.status in UNFINISHED:
        raise HttpError.invalid(
            "previous_response_id",
            f"{body.previous_response_id!r} is {earlier.status} (a background response): "
            "poll it until it ends, then continue it",
        )
    if earlier is None:
        raise HttpError.invalid(
            "previous_response_id",
            f"{body.previous_response_id!r} is not a stored response of this tenant (never "
            "stored, deleted, or dropped from the router's store, which keeps the most "
            f"recently used {store.max_bytes:,} bytes"
            f"{'' if store.files is not None else ' and nothing across a restart'}); "
            "send the conversation in input",
        )
    return earlier


def as_turn(item: Item) -> Item:
    """An output item as the conversation keeps it for a follow-up: without its text's
    logprobs, which a next turn does not read (the response object keeps them)."""
    for part in item.get("content") or ():
        if part.get("type") == "output_text":
            part["logprobs"] = []
    return item


def keep(
    store: ResponseStore,
    tenant: str,
    inputs: tuple[bytes, ...],
    answered: Response,
    earlier: StoredResponse | None,
    dropped: int = 0,
) -> Response:
    """Store the response as `answered` stands (`inputs`: the request's `input_items`, encoded
    once, so their ids stay the same however often it is stored; `dropped`: the turns its
    prompt left out, with truncation auto); the response as stored (`store` false when it is
    larger than the whole store and was not kept)."""
    response = answered.model_copy(update={"store": True})
    outputs = tuple(StoredResponse.encoded(as_turn(item.model_dump())) for item in response.output)
    before = earlier.conversation if earlier is not None else ()
    kept = StoredResponse(
        response=response.model_dump_json().encode(),
        inputs=inputs,
        conversation=(*before, *inputs, *outputs),
        conversation_bytes=(earlier.conversation_bytes if earlier is not None else 0)
        + sum(map(len, inputs + outputs)),
        status=response.status,
        background=response.background,
        dropped=dropped,
        in_conversation=response.conversation["id"] if response.conversation else None,
    )
    if store.put(tenant, response.id, kept):
        return response
    return answered.model_copy(update={"store": False})


def encoded_inputs(body: ResponsesRequest) -> tuple[bytes, ...]:
    return tuple(map(StoredResponse.encoded, input_items(body)))


def input_items(body: ResponsesRequest) -> list[Item]:
    """The request's `input` as OpenAI lists it back (`listed_items`; a string input is one
    user message)."""
    given = (
        [{"type": "message", "role": "user", "content": body.input}]
        if isinstance(body.input, str)
        else body.input
    )
    return listed_items(given)


def listed_items(given: list[Item]) -> list[Item]:
    """Items as OpenAI lists them back: with an `id` and a `status`, a message's content as
    text parts. The chat they render is the one the items as given render."""
    items = []
    for item in given:
        kind = item.get("type", "message")
        listed = {"type": kind, **item}
        if not listed.get("id"):
            listed["id"] = new_item_id(_ID_PREFIX.get(kind, "fco"))
        if kind != "reasoning":
            listed.setdefault("status", "completed")
        else:
            listed.setdefault("summary", [])  # the SDK's reasoning item has one, if empty
        if kind == "message" and isinstance(item.get("content"), str):
            text = {"type": "input_text", "text": item["content"]}
            if item.get("role") == "assistant":
                text = {"type": "output_text", "text": item["content"], "annotations": []}
            listed["content"] = [text]
        items.append(listed)
    return items


def check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise HttpError.invalid("metadata", f"{len(metadata)} pairs; at most {MAX_METADATA_PAIRS}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise HttpError.invalid(
                "metadata", f"key {key[:16]!r}... is over {MAX_METADATA_KEY_CHARS} characters"
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise HttpError.invalid(
                f"metadata.{key}", f"is over {MAX_METADATA_VALUE_CHARS} characters"
            )
