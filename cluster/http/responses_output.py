"""The Responses API's response object (cluster/http/responses_schema.py), from the request as it
starts and from a finished sample: a reasoning item for a thinking model's reasoning, a message
item for the answer's text, a function_call item a call, the usage and the status.

With `include: ["reasoning.encrypted_content"]` (what clients that keep no state on the server,
such as Codex, ask for) a reasoning item carries its text in `encrypted_content`, for the client
to send back in the next turn's input. radixmesh keeps nothing and has no key: the text is
encoded, not encrypted (`sealed`), and an item sent back is read from it when it has neither
`content` nor `summary` (`unsealed`).
"""

from __future__ import annotations

import base64
import binascii
import time
import uuid
from collections.abc import Collection, Sequence
from typing import Literal

from cluster.http.openai_responses import Counts, Sample, chat_logprobs, sample_offsets
from cluster.http.openai_schema import TokenLogprob
from cluster.http.responses_schema import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    Response,
    ResponseError,
    ResponsesRequest,
    ResponseUsage,
)
from cluster.http.token_texts import TokenTexts
from protos.radixmesh.v1 import serving_pb2
from worker.tool_calls import ToolCall, find_calls


def shell(body: ResponsesRequest, response_id: str, model: str, store: bool = False) -> Response:
    """The response as it starts: in progress, no output yet (`store`: to be stored)."""
    choice = body.tool_choice
    form = body.text.format if body.text is not None and body.text.format is not None else None
    return Response(
        id=response_id,
        created_at=0,
        status="in_progress",
        model=model,
        output=[],
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        max_tool_calls=body.max_tool_calls,
        top_logprobs=body.top_logprobs,
        temperature=body.temperature,
        top_p=body.top_p,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        tool_choice=choice.model_dump()
        if choice is not None and not isinstance(choice, str)
        else choice or "auto",
        tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
        text={
            "format": form.model_dump(by_alias=True, exclude_none=True)
            if form
            else {"type": "text"}
        },
        reasoning=body.reasoning.model_dump(exclude_none=True) if body.reasoning else None,
        metadata=body.metadata or {},
        store=store,
        previous_response_id=body.previous_response_id,
        background=bool(body.background),
        truncation=body.truncation or "disabled",
        seal=ENCRYPTED_CONTENT in (body.include or ()),
    ).model_copy(update={"created_at": int(time.time())})


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def done(
    shell: Response,
    content: str | None,
    calls: list[ToolCall],
    finish: str | None,
    counts: Counts,
    message_id: str | None = None,
    call_ids: list[str] | None = None,
    failure: str | None = None,
    thought: str = "",
    reasoning_id: str | None = None,
    cancelled: bool = False,
    failure_code: str = "server_error",
    logprobs: list[TokenLogprob] | None = None,
) -> Response:
    """The finished response: a reasoning item for a thinking model's reasoning (if any), a
    message item for the text (if any), a function_call item a call, the usage; incomplete
    with its reason when max_output_tokens cut it, failed when the generation was aborted (the
    worker stopping) or failed (`failure`), cancelled when its client went away."""
    status: Literal["completed", "incomplete", "failed", "cancelled"] = "completed"
    if cancelled:
        status = "cancelled"
    elif finish == "length":
        status = "incomplete"
    elif finish == "abort" and failure is None:
        failure = "the generation was aborted (its worker is stopping): send it again"
    if failure is not None:
        status = "failed"
    output: list[ReasoningItem | OutputMessage | FunctionCallItem] = []
    if thought:
        answered = bool(content or calls)
        output.append(reasoning_item(reasoning_id, thought, answered, status, shell.seal))
    if content:
        item_status: Literal["completed", "incomplete"] = (
            "completed" if status == "completed" else "incomplete"
        )
        output.append(
            OutputMessage(
                id=message_id or new_item_id("msg"),
                status=item_status,
                content=[OutputText(text=content, logprobs=logprobs or [])],
            )
        )
    ids = call_ids or [new_item_id("fc") for _ in calls]
    output += [
        FunctionCallItem(
            id=each, call_id=c.id, name=c.name, arguments=c.arguments, status="completed"
        )
        for each, c in zip(ids, calls, strict=True)
    ]
    usage = ResponseUsage(
        input_tokens=counts.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=counts.cached_tokens),
        output_tokens=counts.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=counts.reasoning_tokens),
        total_tokens=counts.prompt_tokens + counts.completion_tokens,
    )
    details = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
    error = ResponseError(code=failure_code, message=failure) if failure is not None else None
    return shell.model_copy(
        update={
            "status": status,
            "output": output,
            "usage": usage,
            "incomplete_details": details,
            "error": error,
        }
    )


def reasoning_item(
    item_id: str | None, thought: str, answered: bool, status: str, seal: bool = False
) -> ReasoningItem:
    """The reasoning's item: complete once the answer began, else as the response ends
    (`seal`: with its text in `encrypted_content` too)."""
    whole = answered or status == "completed"
    return ReasoningItem(
        id=item_id or new_item_id("rs"),
        content=[ReasoningText(text=thought)],
        encrypted_content=sealed(thought) if seal else None,
        status="completed" if whole else "incomplete",
    )


ENCRYPTED_CONTENT = "reasoning.encrypted_content"
OUTPUT_LOGPROBS = "message.output_text.logprobs"
INCLUDES = (ENCRYPTED_CONTENT, OUTPUT_LOGPROBS)
"""The `include`s served."""
SEAL = "radixmesh-reasoning-v1:"


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Whether the answer's text comes with its tokens' logprobs."""
    return OUTPUT_LOGPROBS in (body.include or ())


def token_logprobs(
    texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[serving_pb2.TokenLogprob]
) -> list[TokenLogprob]:
    """The tokens' logprobs, as an output_text part carries them."""
    return chat_logprobs(texts, list(token_ids), list(logprobs)).content or []


def message_logprobs(
    texts: TokenTexts, sample: Sample, tools: Collection[str] = ()
) -> list[TokenLogprob]:
    """The logprobs of the answer's message: the sample's tokens after the reasoning's, less
    those of its calls of `tools`. A token is a call's when its text starts inside the call
    (from its tag to the end of its closing tag), so one that begins in the content and runs
    into a call's tag is the content's."""
    text = "".join(sample.text)
    calls = [(begin, end) for _, begin, end in find_calls(text, tools)] if tools else []
    entries = token_logprobs(texts, sample.token_ids, sample.logprobs)
    places = sample_offsets(texts, sample)
    return [
        entry
        for k, (entry, at) in enumerate(zip(entries, places, strict=True))
        if k >= sample.reasoning_tokens and not within(at, calls)
    ]


def within(at: int, calls: Sequence[tuple[int, int]]) -> bool:
    """Whether a character's place is inside one of the calls."""
    return any(begin <= at < end for begin, end in calls)


def sealed(thought: str) -> str:
    """A reasoning's text as `encrypted_content`: encoded, not encrypted."""
    return SEAL + base64.b64encode(thought.encode()).decode()


def unsealed(value: object) -> str | None:
    """The text `sealed` encoded; None for anything else (another server's ciphertext)."""
    if not isinstance(value, str) or not value.startswith(SEAL):
        return None
    try:
        return base64.b64decode(value.removeprefix(SEAL), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
