"""`truncation: "auto"` on the Responses API: a conversation over the model's context loses its
oldest exchanges (OpenAI's rule: items dropped from the beginning), so a long agent session
continued with `previous_response_id` keeps being served instead of refused.

An exchange runs from a user turn to the next one, so a call and its output go together; the
system message (`instructions`) always stays, as does the last exchange. The fewest exchanges
that make the prompt fit, with `max_output_tokens` (or one token) after it, are dropped,
found by bisection over the prompt's counted tokens. Nothing fits: nothing is dropped, and the
serving core refuses the request as over the context. The stored conversation keeps every
item: only what the model reads is cut.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protos.radixmesh.v1 import serving_pb2

if TYPE_CHECKING:
    from cluster.http.app import HttpApi
    from cluster.serving_call import Caller

KEPT_ROLES = ("system", "developer")
"""The leading turns that are never dropped."""


async def truncate(
    api: HttpApi,
    message: serving_pb2.GenerateRequest,
    caller: Caller,
    origins: list[str],
    reserve: int,
) -> int:
    """Drop the oldest exchanges of `message`'s chat (and their `origins`) until its prompt and
    `reserve` tokens fit the context; the number of turns dropped."""
    limits = api.service.request_limits()
    if limits is None:  # no worker: the serving core says so
        return 0
    room = limits.max_model_len - reserve
    turns = list(message.chat.messages)
    head = next((i for i, t in enumerate(turns) if t.role not in KEPT_ROLES), len(turns))
    cuts = [i for i in range(head + 1, len(turns)) if turns[i].role == "user"]

    async def fits(cut: int) -> bool:
        trial = serving_pb2.GenerateRequest()
        trial.CopyFrom(message)
        del trial.chat.messages[head:cut]
        return len(await api.service.count_prompt(trial, caller)) <= room

    if not cuts or await fits(head):
        return 0
    low, high = 0, len(cuts) - 1  # the fewest exchanges dropped that fit: cuts[high] must
    if not await fits(cuts[high]):
        return 0
    while low < high:
        middle = (low + high) // 2
        if await fits(cuts[middle]):
            high = middle
        else:
            low = middle + 1
    cut = cuts[high]
    del message.chat.messages[head:cut]
    del origins[head:cut]
    return cut - head
