"""The Responses API's stored responses (`store`, `previous_response_id`, `GET` and `DELETE
/v1/responses/{id}`), kept in the router's memory, each its tenant's, within one bound in bytes.

A stored response keeps three things: the response object as it was answered, the request's
own `input` items (`GET .../input_items`), and the conversation a follow-up continues: the
items of every earlier turn of its chain, its input and its output. A request that names it in
`previous_response_id` is answered as if it had sent that conversation before its own input,
so agents send only their new turn; the router renders the same chat and routes it to the
worker whose cache holds it.

Everything is kept encoded as JSON. The bound is on what each stored response would need alone (its
whole conversation and its response object), so it holds however the turns share their items; it is
one bound over every tenant's responses. The tenant holding the most gives up its least recently
stored or read response first (cluster/http/kept_store.py); a response larger than the whole store
is not kept (its `store` then says false). With `router.state_dir` each is written there too and
read back by the next router (cluster/http/kept_files.py); without it nothing survives a restart,
as nothing survives one of vLLM's or SGLang's in-memory stores: a follow-up naming a lost response
is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.http.kept_files import json_text
from cluster.http.kept_store import KeptStore

ENTRY_BYTES = 640
"""What Python takes to hold one stored response beside its items' bytes (the key, the entry,
the dataclass, the response's bytes object)."""
ITEM_BYTES = 64
"""What Python takes to hold one item beside its bytes (a bytes object, its tuple slots)."""
Item = dict[str, Any]
"""An item of the Responses API, as JSON: a message, reasoning, function_call or its output."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """Kept encoded (JSON bytes), so the bound is on what the store holds, not on an estimate
    of Python objects three times their JSON's size."""

    response: bytes
    """The response object, as answered."""
    inputs: tuple[bytes, ...]
    """The request's own input items, each with an `id`."""
    conversation: tuple[bytes, ...]
    """What a follow-up continues: every earlier turn's items, `inputs` and the output (the
    earlier turns' are the same bytes objects as in the response they came from)."""
    conversation_bytes: int
    """The sum of `conversation`'s lengths (grown turn by turn, never summed whole)."""
    status: str = "completed"
    """The response's status: a follow-up of one "queued" or "in_progress" is refused."""
    background: bool = False
    """A background response's (only one can be cancelled, or its events followed)."""
    dropped: int = 0
    """With truncation auto: the turns after the conversation's head its prompt left out
    (cluster/http/responses_truncation.py); a follow-up starts from the same cut."""
    in_conversation: str | None = None
    """The conversation it was made in (cluster/http/conversations.py): it is continued there,
    not by `previous_response_id`, as its chain holds only its own turn."""

    @property
    def size(self) -> int:
        """What the store counts against its bound: the bytes, and what Python adds to keep
        them (an object a bytes string, the tuples, the entry: measured with tracemalloc)."""
        items = len(self.conversation) + len(self.inputs)
        return self.conversation_bytes + len(self.response) + ENTRY_BYTES + items * ITEM_BYTES

    @staticmethod
    def encoded(item: Item) -> bytes:
        return json.dumps(item).encode()

    @staticmethod
    def decoded(items: tuple[bytes, ...]) -> list[Item]:
        return [json.loads(item) for item in items]


class ResponseStore(KeptStore[StoredResponse]):
    """Stored responses by (tenant, id), the largest tenant's least recently used dropped first
    beyond `max_bytes`.
    Used from the router's event loop only."""

    def __init__(self, max_bytes: int, directory: Path | None = None) -> None:
        super().__init__(max_bytes, directory)
        self._shared: dict[bytes, bytes] = {}
        """While restoring: each item read back once, so a chain's turns share their earlier
        items again as they did before the restart (each file holds its whole chain)."""

    def restore(self) -> int:
        try:
            return super().restore()
        finally:
            self._shared = {}

    def saved(self, value: StoredResponse) -> dict[str, Any]:
        return {
            "response": value.response.decode(),
            "inputs": [item.decode() for item in value.inputs],
            "conversation": [item.decode() for item in value.conversation],
            "status": value.status,
            "background": value.background,
            "dropped": value.dropped,
            "in_conversation": value.in_conversation,
        }

    def restored(self, saved: dict[str, Any]) -> StoredResponse:
        """As saved; one that was still running (the router went down under it, without the
        stop that ends it cancelled) is failed, as nothing will end it now."""
        conversation = tuple(self._once(item) for item in saved["conversation"])
        response, status = json_text(saved["response"]), str(saved["status"])
        if status in RUNNING:
            status = "failed"
            response = json.dumps(json.loads(response) | {"status": status, "error": LOST}).encode()
        return StoredResponse(
            response=response,
            inputs=tuple(self._once(item) for item in saved["inputs"]),
            conversation=conversation,
            conversation_bytes=sum(map(len, conversation)),
            status=status,
            background=bool(saved["background"]),
            dropped=int(saved["dropped"]),
            in_conversation=None if (held := saved["in_conversation"]) is None else str(held),
        )

    def _once(self, item: Any) -> bytes:
        encoded = json_text(item)
        return self._shared.setdefault(encoded, encoded)


RUNNING = ("queued", "in_progress")
LOST = {"code": "server_error", "message": "the router stopped while the response ran"}
