"""`truncation: "auto"` on the Responses API: a conversation the serving core refuses as over the
model's context loses turns from its beginning (OpenAI's rule: items dropped from the start of
the conversation), so a long session continued with `previous_response_id` keeps being served.

    turns:  [ system | first exchange | dropped ........... | kept .................. ]
              the head, always kept         a cut: a user turn, or an assistant turn
                                            right after a tool's output

- **Only when refused.** A request is served as it comes; only one the serving core refuses for
  its length (`context_length_exceeded`, or over `engine.max_prompt_chars`) is counted and cut,
  so a conversation that fits costs nothing more.
- **The head stays**: the instructions and the first exchange, up to the first place a cut
  could fall: the first turn and its answer, or an agent's task with its first call and that
  call's output. A cut falls before a user turn, or before an assistant turn that follows a
  tool's output (the next step of a loop of calls after a single user turn), so it never parts
  a call from its output, and what is kept still alternates as the head did (templates that
  insist on alternating turns accept it). A cut the core refuses for another reason than
  length (a template's) counts as one that does not fit.
- **With slack.** The cut is the first that leaves the prompt within three quarters of the
  room (the context less `max_output_tokens`, or one token), found by bisection over counted
  prompts; failing that, the first that fits the room at all. The response keeps its cut in the
  store, and a follow-up starts from it: the next turns' prompts begin as this one did, so they
  hit the cache it left, until the conversation outgrows the room again and the cut moves on
  by a quarter of it. Cutting only what is needed each time would change the prompt's start,
  and miss the cache, on every turn.
- Nothing fits (the head and the last turn alone are over it): the original refusal stands.
- A follow-up of a cut response starts from the cut even if its whole conversation would fit:
  that is the prompt the cache holds.

The stored conversation keeps every item: only what the model reads is cut.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import grpc

from cluster.serving_call import ServingError
from protos.radixmesh.v1 import serving_pb2
from worker.errors import ContextOverflow, PromptTooLarge

if TYPE_CHECKING:
    from cluster.http.openai_responses import Responses

KEPT_ROLES = ("system", "developer")
"""The leading turns the head keeps before the first turn."""
SLACK = 0.75
"""A new cut leaves the prompt within this fraction of the room."""
OVER_LENGTH = (ContextOverflow.reason, PromptTooLarge.reason)


def over_length(err: ServingError) -> bool:
    """Whether the serving core refused a request for its length (what a cut may cure)."""
    return err.reason in OVER_LENGTH


def cuts(turns: Sequence[serving_pb2.ChatMessage]) -> tuple[int, list[int]]:
    """(head, the turns a conversation may be cut before): `turns[head:cut]` may be dropped.
    The head runs to the first place a cut could fall after the first turn that is not a
    system one."""
    roles = [turn.role for turn in turns]
    first = next((i for i, role in enumerate(roles) if role not in KEPT_ROLES), len(roles))
    points = [
        j
        for j in range(first + 1, len(roles))
        if roles[j] == "user" or (roles[j] == "assistant" and roles[j - 1] == "tool")
    ]
    return (points[0], points[1:]) if points else (len(roles), [])


class Truncation:
    """One request's cut: `dropped` turns after the head (0: none), set as it is served."""

    def __init__(
        self,
        message: serving_pb2.GenerateRequest,
        origins: list[str],
        reserve: int,
        earlier: int = 0,
    ) -> None:
        """`origins`: the field each turn came from, cut with the turns (refusals name them).
        `reserve`: the tokens the answer needs after the prompt. `earlier`: the cut of the
        response this one continues, tried first."""
        self.message, self.origins, self.reserve = message, origins, reserve
        self.head, self.cuts = cuts(message.chat.messages)
        self.dropped = 0
        cut = self.head + earlier
        if earlier and cut in self.cuts:
            self._drop(cut)

    def _drop(self, cut: int) -> None:
        """Drop the turns before `cut` after the head (of the conversation as it came)."""
        now = self.head + self.dropped  # the turns already dropped are gone from the message
        del self.message.chat.messages[self.head : self.head + cut - now]
        del self.origins[self.head : self.head + cut - now]
        self.dropped = cut - self.head

    async def serve(
        self,
        stream: Responses,
        start: Callable[[serving_pb2.GenerateRequest], Responses],
        count: Callable[[serving_pb2.GenerateRequest], Awaitable[int]],
        max_model_len: int,
        refused: Callable[[ServingError], None],
    ) -> Responses:
        """`stream`, the request's, as it is; cut and sent again (`start`) when the serving core
        refuses it for its length. `count`: a prompt's tokens (raises ServingError when it
        cannot even be counted: over the characters the core reads). `stream`'s refusal for
        its length is not counted under its status (`over_length`): `refused` counts it when
        it stands, nothing fitting, or what ended the search for a cut (counting a prompt
        counts nothing). The stream served is closed with this one, so its worker call ends
        with the client's."""
        try:
            try:
                first = await anext(stream)
            except ServingError as err:
                if not over_length(err):
                    raise
                try:
                    cut = await self._cut(count, max_model_len)
                except ServingError as failed:  # no worker left to count with, say
                    refused(failed)
                    raise
                if cut is None:
                    refused(err)
                    raise
                self._drop(cut)
                stream = start(self.message)
                first = await anext(stream)
            yield first
            async for response in stream:
                yield response
        finally:
            await stream.aclose()

    async def _cut(
        self, count: Callable[[serving_pb2.GenerateRequest], Awaitable[int]], max_model_len: int
    ) -> int | None:
        """The first cut past the current one that leaves the prompt within SLACK of the room,
        else the first that fits it; None when none does."""
        room = max_model_len - self.reserve
        later = [cut for cut in self.cuts if cut > self.head + self.dropped]
        counted: dict[int, int | None] = {}  # cut -> its prompt's tokens (None: refused)

        async def fits(cut: int, within: int) -> bool:
            if cut not in counted:
                trial = serving_pb2.GenerateRequest()
                trial.CopyFrom(self.message)
                now = self.head + self.dropped
                del trial.chat.messages[self.head : self.head + cut - now]
                try:
                    counted[cut] = await count(trial)
                except ServingError as err:  # too long to count, or a template's refusal
                    if err.code != grpc.StatusCode.INVALID_ARGUMENT:
                        raise
                    counted[cut] = None
            tokens = counted[cut]
            return tokens is not None and tokens <= within

        for within in (int(SLACK * room), room):
            if not later or not await fits(later[-1], within):
                continue
            low, high = 0, len(later) - 1  # later[high] fits: the first that does
            while low < high:
                middle = (low + high) // 2
                if await fits(later[middle], within):
                    high = middle
                else:
                    low = middle + 1
            return later[high]
        return None
