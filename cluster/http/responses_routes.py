"""POST /v1/responses (OpenAI's Responses API, text and function calls, streamed or not) over
the same serving core as chat completions.

`input` (a string, or message, `function_call` and `function_call_output` items) and
`instructions` become the chat; `tools`, `tool_choice` and `parallel_tool_calls` the core's; and
`text.format` (json_object, json_schema) a structured output. The answer's text becomes a
`message` item and its calls `function_call` items (worker/tool_calls.py reads them out of the
text); `status` is `incomplete` (reason `max_output_tokens`) when max_output_tokens cut it.

Streamed, the events are OpenAI's: `response.created`, `response.in_progress`, then for the
text an `output_item.added`, a `content_part.added`, its `output_text.delta`s and the `.done`s,
then each call's item with its arguments in one `function_call_arguments.delta`, and
`response.completed` (or `response.incomplete`) with the whole response; each event carries
its `sequence_number`. The text item opens only when there is text, so the streamed response
is the one a non-streamed request gets.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response as HttpResponse

from cluster.http.errors import GenerationFailed, HttpError, Renames, renames
from cluster.http.openai_params import ROLES, refuse_unsupported, wire_tool
from cluster.http.openai_responses import (
    Counts,
    HeldCalls,
    Responses,
    collect,
    prepend,
    read,
    served_by,
)
from cluster.http.responses_schema import (
    REFUSED,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    NamedFunction,
    OutputMessage,
    OutputText,
    Response,
    ResponseError,
    ResponsesRequest,
    ResponseUsage,
)
from cluster.http.sse import EventStream
from cluster.serving_call import ServingError
from protos.radixmesh.v1 import serving_pb2
from worker.tool_calls import ToolCall, read_calls

if TYPE_CHECKING:
    from cluster.http.app import HttpApi

TEXT_PARTS = ("input_text", "output_text")
"""The content parts of an input message served (an assistant's earlier turn is output_text)."""


def add_routes(app: FastAPI, api: HttpApi) -> None:
    async def responses(body: ResponsesRequest, request: Request) -> HttpResponse:
        caller = api.caller(request)
        adapter = api.check_model(body.model)
        rid = api.request_id(request)
        message, origins = generate_request(body, rid, api.tenant(request))
        message.namespace.adapter = adapter or ""
        shell = _shell(body, f"resp_{rid}", adapter or api.model)
        tools = (
            frozenset(t.name for t in body.tools or [])
            if body.tool_choice != "none"
            else frozenset()
        )
        stream = api.start(message, caller, fill_context=True)
        rename = refusal_names(body, origins)
        if body.stream:
            first = await api.finish(request, anext(stream), rename)  # a refusal: a status
            return EventStream(events(shell, first, stream, tools), served_by(first))
        samples, counts = await api.finish(request, collect(stream), rename)
        sample = samples[0]
        text = "".join(sample.text)
        content, calls = read_calls(text, tools) if tools else (text, [])
        done = _done(shell, content, calls, sample.finish_reason, counts)
        return HttpResponse(
            done.model_dump_json(), media_type="application/json", headers=counts.served_by()
        )

    app.add_api_route("/v1/responses", responses, methods=["POST"])


def refusal_names(body: ResponsesRequest, origins: list[str]) -> Renames:
    """The Responses API's names of the fields the serving core may refuse: a turn of the chat
    is named by the item it came from (`origins`, from `conversation`)."""
    fields = {
        "sampling.structured.json_schema": "text.format.schema",
        "sampling.structured.json_object": "text.format",
        "sampling.structured.structural_tag": "tools",
        "max_tokens": "max_output_tokens",
        "messages": "input",
        "prompt": "input",
    }
    if isinstance(body.tool_choice, NamedFunction):
        fields["tool_choice"] = "tool_choice.name"  # the function it names
    named = renames(fields)

    def rename(param: str) -> str | None:
        turn = _TURN.fullmatch(param)
        if turn is not None and int(turn[1]) < len(origins):
            return origins[int(turn[1])] + turn[2]
        return named(param)

    return rename


_TURN = re.compile(r"messages\[(\d+)\](.*)")


def generate_request(
    body: ResponsesRequest, request_id: str, tenant: str
) -> tuple[serving_pb2.GenerateRequest, list[str]]:
    """The request, and the field each turn of its chat came from."""
    refuse_unsupported(body, REFUSED)
    message = serving_pb2.GenerateRequest(request_id=request_id)
    # a thinking model's reasoning is left out of the output, as OpenAI's reasoning models
    # keep theirs to themselves (docs/serving.md)
    message.sampling.separate_reasoning = True
    origins = conversation(body, message.chat.messages)
    for name, value in (
        ("max_tokens", body.max_output_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
    ):
        if value is not None:
            if name == "max_tokens" and not 0 <= value <= 2**31 - 1:
                raise HttpError.invalid("max_output_tokens", f"{value} is out of range")
            setattr(message.sampling, name, value)
    _format(body, message.sampling)
    message.tools.extend(
        wire_tool(tool.name, tool.description, tool.parameters) for tool in body.tools or []
    )
    choice = body.tool_choice
    if choice is not None:
        message.tool_choice = choice if isinstance(choice, str) else choice.name
    if body.parallel_tool_calls is not None:
        message.parallel_tool_calls = body.parallel_tool_calls
    message.namespace.tenant = tenant
    return message, origins


def _format(body: ResponsesRequest, params: serving_pb2.SamplingParams) -> None:
    form = body.text.format if body.text is not None else None
    if form is None or form.type == "text":
        return
    if form.type == "json_object":
        params.structured.json_object = True
        return
    for name in ("name", "schema_"):
        if getattr(form, name) is None:
            raise HttpError.invalid(
                f"text.format.{name.rstrip('_')}", "is required with type json_schema"
            )
    params.structured.json_schema = json.dumps(form.schema_)


def conversation(body: ResponsesRequest, turns: Any) -> list[str]:
    """Append `instructions` as the system message, then `input`'s items as the chat's turns,
    to `turns`; returns the field each turn came from. A string is one user turn; consecutive
    `function_call` items are one assistant turn's calls (with the assistant message before
    them, if any); a `function_call_output` is a tool turn."""
    origins = []
    if body.instructions is not None:
        turns.append(serving_pb2.ChatMessage(role="system", content=body.instructions))
        origins.append("instructions")
    if isinstance(body.input, str):
        turns.append(serving_pb2.ChatMessage(role="user", content=body.input))
        return [*origins, "input"]
    if not body.input:
        raise HttpError.invalid("input", "is empty; send at least one item")
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            turns.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            if len(turns) and turns[-1].role == "assistant":
                turns[-1].tool_calls.append(call)  # one turn with what came before it
                continue
            turns.append(serving_pb2.ChatMessage(role="assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            turns.append(_function_output(item, where))
        else:
            raise HttpError.invalid(
                f"{where}.type",
                f"{kind!r}: the items served are message, function_call and function_call_output",
            )
        origins.append(where)
    return origins


def _message(item: dict[str, Any], where: str) -> serving_pb2.ChatMessage:
    unknown = set(item) - {"type", "role", "content", "id", "status"}
    if unknown:
        raise HttpError.invalid(f"{where}.{sorted(unknown)[0]}", "is not a field of a message")
    given = item.get("role")
    role = ROLES.get(given) if isinstance(given, str) else None
    if role is None or role == "tool":
        raise HttpError.invalid(
            f"{where}.role",
            f"{item.get('role')!r} is not one of system, developer, user, assistant",
        )
    content = item.get("content")
    if isinstance(content, str):
        return serving_pb2.ChatMessage(role=role, content=content)
    if not isinstance(content, list):
        raise HttpError.invalid(f"{where}.content", "must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise HttpError.invalid(
                f"{where}.content[{j}]",
                f"only input_text and output_text parts are served, got {kind!r}",
            )
        texts.append(part["text"])
    return serving_pb2.ChatMessage(role=role, content="\n".join(texts))


def _function_call(item: dict[str, Any], where: str) -> serving_pb2.ToolCall:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    for field, value in (("call_id", call_id), ("name", name), ("arguments", arguments)):
        if not isinstance(value, str):
            raise HttpError.invalid(f"{where}.{field}", "is required, a string")
    try:
        parsed = json.loads(arguments)  # type: ignore[arg-type]
    except ValueError as err:
        raise HttpError.invalid(f"{where}.arguments", f"is not JSON: {err}") from None
    if not isinstance(parsed, dict):
        raise HttpError.invalid(f"{where}.arguments", "is a JSON object of the arguments")
    return serving_pb2.ToolCall(id=call_id, name=name, arguments=arguments)


def _function_output(item: dict[str, Any], where: str) -> serving_pb2.ChatMessage:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str):
        raise HttpError.invalid(f"{where}.call_id", "is required, a string")
    if isinstance(output, list):  # text parts
        texts = [
            p.get("text") for p in output if isinstance(p, dict) and p.get("type") in TEXT_PARTS
        ]
        if len(texts) != len(output) or not all(isinstance(t, str) for t in texts):
            raise HttpError.invalid(f"{where}.output", "only input_text parts are served")
        output = "\n".join(texts)  # type: ignore[arg-type]
    if not isinstance(output, str):
        raise HttpError.invalid(f"{where}.output", "must be a string or text parts")
    return serving_pb2.ChatMessage(role="tool", content=output, tool_call_id=call_id)


# -- the response ----------------------------------------------------------------------------
def _shell(body: ResponsesRequest, response_id: str, model: str) -> Response:
    """The response as it starts: in progress, no output yet."""
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
    ).model_copy(update={"created_at": int(time.time())})


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _done(
    shell: Response,
    content: str | None,
    calls: list[ToolCall],
    finish: str | None,
    counts: Counts,
    message_id: str | None = None,
    call_ids: list[str] | None = None,
    failure: str | None = None,
) -> Response:
    """The finished response: a message item for the text (if any), a function_call item a
    call, the usage; incomplete with its reason when max_output_tokens cut it, failed when the
    generation was aborted (the worker stopping) or failed (`failure`)."""
    status: Literal["completed", "incomplete", "failed"] = "completed"
    if finish == "length":
        status = "incomplete"
    elif finish == "abort" and failure is None:
        failure = "the generation was aborted (its worker is stopping): send it again"
    if failure is not None:
        status = "failed"
    output: list[OutputMessage | FunctionCallItem] = []
    if content:
        item_status: Literal["completed", "incomplete"] = (
            "completed" if status == "completed" else "incomplete"
        )
        output.append(
            OutputMessage(
                id=message_id or _item_id("msg"),
                status=item_status,
                content=[OutputText(text=content)],
            )
        )
    ids = call_ids or [_item_id("fc") for _ in calls]
    output += [
        FunctionCallItem(
            id=item_id, call_id=c.id, name=c.name, arguments=c.arguments, status="completed"
        )
        for item_id, c in zip(ids, calls, strict=True)
    ]
    usage = ResponseUsage(
        input_tokens=counts.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=counts.cached_tokens),
        output_tokens=counts.completion_tokens,
        total_tokens=counts.prompt_tokens + counts.completion_tokens,
    )
    details = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
    error = ResponseError(code="server_error", message=failure) if failure is not None else None
    return shell.model_copy(
        update={
            "status": status,
            "output": output,
            "usage": usage,
            "incomplete_details": details,
            "error": error,
        }
    )


async def events(
    shell: Response,
    first: serving_pb2.GenerateResponse,
    rest: Responses,
    tools: frozenset[str],
) -> AsyncIterator[bytes]:
    """The response's events (module docstring); a failure mid-way is an `error` event."""
    sequence = 0

    def event(kind: str, data: dict[str, Any]) -> bytes:
        nonlocal sequence
        data = {"type": kind, "sequence_number": sequence, **data}
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    yield event("response.created", {"response": shell.model_dump()})
    yield event("response.in_progress", {"response": shell.model_dump()})
    counts = Counts()
    held = HeldCalls(tools) if tools else None
    message_id, text, calls, finish = _item_id("msg"), "", list[ToolCall](), None
    where = {"item_id": message_id, "output_index": 0, "content_index": 0}
    try:
        async with contextlib.aclosing(read(prepend(first, rest), counts)) as responses:
            async for response in responses:
                delta = held.feed(response.text) if held is not None else response.text
                if response.finished:
                    finish = response.finish_reason
                    if held is not None:
                        more, calls = held.finish()
                        delta += more
                if not delta:
                    continue
                if not text:
                    item = OutputMessage(id=message_id, status="in_progress", content=[])
                    yield event(
                        "response.output_item.added", {"output_index": 0, "item": item.model_dump()}
                    )
                    part = OutputText(text="").model_dump()
                    yield event(
                        "response.content_part.added",
                        {k: v for k, v in where.items()} | {"part": part},
                    )
                text += delta
                yield event("response.output_text.delta", where | {"delta": delta, "logprobs": []})
    except (ServingError, GenerationFailed) as err:  # as OpenAI ends a stream that failed
        failed = _done(shell, None, [], None, counts, failure=HttpError.of(err).message)
        yield event("response.failed", {"response": failed.model_dump()})
        return
    done = _done(shell, text or None, calls, finish, counts, message_id, None)
    if text:
        yield event("response.output_text.done", where | {"text": text, "logprobs": []})
        part = OutputText(text=text).model_dump()
        yield event("response.content_part.done", where | {"part": part})
        yield event(
            "response.output_item.done", {"output_index": 0, "item": done.output[0].model_dump()}
        )
    for index, output in enumerate(done.output[1:] if text else done.output, start=int(bool(text))):
        assert isinstance(output, FunctionCallItem)
        opened = output.model_copy(update={"arguments": "", "status": "in_progress"}).model_dump()
        yield event("response.output_item.added", {"output_index": index, "item": opened})
        at = {"item_id": output.id, "output_index": index}
        yield event("response.function_call_arguments.delta", at | {"delta": output.arguments})
        yield event(
            "response.function_call_arguments.done",
            at | {"arguments": output.arguments, "name": output.name},
        )
        yield event(
            "response.output_item.done", {"output_index": index, "item": output.model_dump()}
        )
    yield event(f"response.{done.status}", {"response": done.model_dump()})
