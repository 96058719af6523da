"""A streamed Responses API response: OpenAI's events, each with its `sequence_number`.

    response.created, response.in_progress
    a thinking model's reasoning (vLLM's events for it):
        output_item.added (reasoning), content_part.added, reasoning_text.delta ...,
        reasoning_text.done, content_part.done, output_item.done    at the answer's first text
    the answer's text:
        output_item.added (message), content_part.added, output_text.delta ...,
        output_text.done, content_part.done, output_item.done       at the end
    each call: output_item.added, function_call_arguments.delta (all of it) and .done,
        output_item.done
    response.completed (or .incomplete), with the whole response; response.failed mid-way

A client that goes away mid-stream leaves a `cancelled` response, with what it was sent.

An item opens only when it has text, so the streamed response is the one a request that is not
streamed gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from cluster.http.errors import GenerationFailed, HttpError, Renames
from cluster.http.openai_responses import (
    Counts,
    HeldCalls,
    Responses,
    prepend,
    read,
    token_offsets,
)
from cluster.http.openai_schema import TokenLogprob
from cluster.http.responses_output import (
    done,
    new_item_id,
    reasoning_item,
    token_logprobs,
    within,
)
from cluster.http.responses_schema import (
    FunctionCallItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    Response,
)
from cluster.http.token_texts import TokenTexts
from cluster.serving_call import ServingError
from protos.radixmesh.v1 import serving_pb2
from worker.tool_calls import ToolCall

log = logging.getLogger(__name__)


async def events(
    shell: Response,
    first: serving_pb2.GenerateResponse | None,
    rest: Responses,
    tools: frozenset[str],
    ended: Callable[[Response], Response] = lambda response: response,
    rename: Renames | None = None,
    texts: TokenTexts | None = None,
) -> AsyncGenerator[bytes, None]:
    """The response's events (module docstring), from `first` and `rest` (the whole stream in
    `rest` when `first` is None). The response as it stands goes through `ended` (storing it):
    `in_progress` at the start when `shell` is a background one's `queued`, and as it ends
    (completed, incomplete, failed, or cancelled by the client going away) before its last
    event. A refusal's message names the field as the request did (`rename`). With `texts`,
    each text delta carries the logprobs of the answer's tokens since the last one."""
    out = _Events(shell.seal)
    counts = Counts()
    held = HeldCalls(tools) if tools else None
    calls: list[ToolCall] = []
    finish = None
    failure, code = None, "server_error"
    started = shell.model_copy(update={"status": "in_progress"})
    try:
        yield out.event("response.created", {"response": shell.model_dump()})
        yield out.event("response.in_progress", {"response": started.model_dump()})
        if shell.status == "queued":
            ended(started)
        stream = prepend(first, rest) if first is not None else rest
        async with contextlib.aclosing(read(stream, counts)) as responses:
            async for response in responses:
                if response.reasoning_text:
                    yield out.think(response.reasoning_text)
                if texts is not None:
                    out.take(texts, response)
                delta = held.feed(response.text) if held is not None else response.text
                if response.finished:
                    finish = response.finish_reason
                    if held is not None:
                        more, calls = held.finish()
                        delta += more
                        out.drop(held.spans)
                if delta:  # with calls held, only the logprobs of the text let out so far
                    before = held.sent if held is not None and not response.finished else None
                    yield out.write(delta, before)
    except (ServingError, GenerationFailed) as err:  # as OpenAI ends a stream that failed
        refusal = HttpError.of(err)
        failure = (refusal.renamed(rename) if rename else refusal).message
        code = ERROR_CODES.get(refusal.status, code)
    except (GeneratorExit, asyncio.CancelledError):  # the client went away (closed or cancelled
        # at a yield, or cancelled waiting for a token): what it was sent, as the response ends
        gone = done(
            started, out.text or None, [], None, counts, out.message_id,
            thought=out.thought, reasoning_id=out.reasoning_id, cancelled=True,
            logprobs=out.logprobs,
        )  # fmt: skip
        ended(gone)
        raise
    except Exception as err:  # a bug: the response still ends, and says so
        log.exception("response %s failed", shell.id)
        failure = f"the router failed generating it: {type(err).__name__}: {err}"
    if failure is not None:  # with what was sent so far
        failed = done(
            started, out.text or None, [], None, counts, out.message_id,
            failure=failure, thought=out.thought, reasoning_id=out.reasoning_id,
            failure_code=code, logprobs=out.logprobs,
        )  # fmt: skip
        yield out.event("response.failed", {"response": ended(failed).model_dump()})
        return
    finished = done(
        started, out.text or None, calls, finish, counts, out.message_id,
        thought=out.thought, reasoning_id=out.reasoning_id,
        logprobs=out.logprobs + out.held,  # a held stop string's tokens too
    )  # fmt: skip
    yield out.end(ended(finished))


ERROR_CODES = {400: "invalid_prompt", 413: "invalid_prompt", 429: "rate_limit_exceeded"}
"""A refusal's status -> the code of OpenAI's ResponseError (else "server_error")."""


class _Events:
    """The events of one response, numbered, and its reasoning and message items as they go."""

    def __init__(self, seal: bool) -> None:
        self.seal = seal
        """Reasoning items carry `encrypted_content` (responses_output.py)."""
        self.sequence = 0
        self.reasoning_id, self.message_id = new_item_id("rs"), new_item_id("msg")
        self.thought = ""
        """The reasoning so far."""
        self.text = ""
        """The answer's text so far."""
        self.logprobs: list[TokenLogprob] = []
        """The logprobs sent with the text so far (asked for: `events`'s `texts`)."""
        self.pending: list[tuple[int, int, TokenLogprob]] = []
        """Those of tokens whose text is not sent yet (held: a possible stop string or call),
        each with its token's place in the sample and where its text starts in the sample's."""
        self.tokens = self.reasoned = self.chars = 0
        """The sample's tokens so far, of these the reasoning's (which come first), and the
        characters of its text."""

    def take(self, texts: TokenTexts, response: serving_pb2.GenerateResponse) -> None:
        """A message's tokens' logprobs, held until their text is sent, less the reasoning's:
        a message's count of reasoning tokens may take in tokens of earlier ones (held text
        that turned out to open the reasoning), so the cut is by place in the sample."""
        entries = token_logprobs(texts, response.token_ids, response.logprobs)
        ids = list(response.token_ids)
        reasoning = min(max(self.reasoned + response.reasoning_tokens - self.tokens, 0), len(ids))
        places = token_offsets(texts, ids, self.chars, len(response.text), reasoning)
        self.pending += [
            (self.tokens + k, at, entry)
            for k, (entry, at) in enumerate(zip(entries, places, strict=True))
        ]
        self.tokens += len(entries)
        self.chars += len(response.text)
        self.reasoned += response.reasoning_tokens
        self.pending = [each for each in self.pending if each[0] >= self.reasoned]

    def drop(self, calls: list[tuple[int, int]]) -> None:
        """The logprobs of the calls' tokens (those whose text starts inside one) are not the
        message's (responses_output.message_logprobs)."""
        self.pending = [each for each in self.pending if not within(each[1], calls)]

    @property
    def held(self) -> list[TokenLogprob]:
        return [entry for _, _, entry in self.pending]

    def event(self, kind: str, data: dict[str, Any]) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    def think(self, delta: str) -> bytes:
        out = b""
        if not self.thought:
            item = ReasoningItem(id=self.reasoning_id, content=[], status="in_progress")
            out += self._opened(0, item, ReasoningText(text=""))
        self.thought += delta
        return out + self.event(
            "response.reasoning_text.delta", self._at_reasoning | {"delta": delta}
        )

    def write(self, delta: str, before: int | None = None) -> bytes:
        """A text delta, with the held logprobs (`before`: only of tokens whose text starts
        before that character of the sample's text)."""
        out = b""
        if not self.text:
            if self.thought:  # the answer began: the reasoning is whole
                whole = reasoning_item(
                    self.reasoning_id, self.thought, True, "completed", self.seal
                )
                out += self._closed(whole)
            item = OutputMessage(id=self.message_id, status="in_progress", content=[])
            out += self._opened(self._message_index, item, OutputText(text=""))
        self.text += delta
        going = [e for e in self.pending if before is None or e[1] < before]
        self.pending = [e for e in self.pending if before is not None and e[1] >= before]
        sent = [entry for _, _, entry in going]
        self.logprobs += sent
        at = self._at_message | {"delta": delta, "logprobs": [e.model_dump() for e in sent]}
        return out + self.event("response.output_text.delta", at)

    def end(self, finished: Response) -> bytes:
        """What is still open, closed as `finished` has it; then the calls and the end."""
        out = b""
        items = list(finished.output)
        if self.thought:
            reasoning = items.pop(0)
            if not self.text:  # cut while thinking: it ends with the response
                assert isinstance(reasoning, ReasoningItem)
                out += self._closed(reasoning)
        if self.text:
            answer = items.pop(0)
            assert isinstance(answer, OutputMessage)
            out += self._closed(answer)
        for index, call in enumerate(items, start=len(finished.output) - len(items)):
            assert isinstance(call, FunctionCallItem)
            out += self._call(index, call)
        return out + self.event(f"response.{finished.status}", {"response": finished.model_dump()})

    @property
    def _message_index(self) -> int:
        return int(bool(self.thought))

    @property
    def _at_reasoning(self) -> dict[str, Any]:
        return {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}

    @property
    def _at_message(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": self._message_index, "content_index": 0}

    def _opened(
        self, index: int, item: ReasoningItem | OutputMessage, part: ReasoningText | OutputText
    ) -> bytes:
        at = self._at_reasoning if isinstance(item, ReasoningItem) else self._at_message
        added = {"output_index": index, "item": item.model_dump()}
        return self.event("response.output_item.added", added) + self.event(
            "response.content_part.added", at | {"part": part.model_dump()}
        )

    def _closed(self, item: ReasoningItem | OutputMessage) -> bytes:
        """An item's text part done, then the item."""
        part = item.content[0]
        more: dict[str, Any] = {}
        if isinstance(item, ReasoningItem):
            at, kind = self._at_reasoning, "reasoning_text"
        else:
            at, kind = self._at_message, "output_text"
            more = {"logprobs": part.model_dump()["logprobs"]}
        return (
            self.event(f"response.{kind}.done", at | {"text": part.text} | more)
            + self.event("response.content_part.done", at | {"part": part.model_dump()})
            + self.event(
                "response.output_item.done",
                {"output_index": at["output_index"], "item": item.model_dump()},
            )
        )

    def _call(self, index: int, call: FunctionCallItem) -> bytes:
        opened = call.model_copy(update={"arguments": "", "status": "in_progress"}).model_dump()
        at = {"item_id": call.id, "output_index": index}
        return (
            self.event("response.output_item.added", {"output_index": index, "item": opened})
            + self.event("response.function_call_arguments.delta", at | {"delta": call.arguments})
            + self.event(
                "response.function_call_arguments.done",
                at | {"arguments": call.arguments, "name": call.name},
            )
            + self.event(
                "response.output_item.done", {"output_index": index, "item": call.model_dump()}
            )
        )
